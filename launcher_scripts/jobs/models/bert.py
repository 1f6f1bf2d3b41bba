"""BERT's torch side: megatron-core's BertModel over BERTMaskedWordPieceDataset's samples, a
masked-LM loss plus, with `bert_binary_head`, sentence-order prediction.

Two layer layouts, chosen by `model.transformer_block_type`:
- `pre_ln` (the NeMo launcher's BERT, megatron-core's stock spec): x + Attn(LN(x)), a final
  LayerNorm after the stack, no LayerNorm on the embeddings. Hugging Face's
  MegatronBertForPreTraining is this model.
- `post_ln` (the original BERT, Hugging Face's BertForPreTraining): LN(x + Attn(x)), no final
  LayerNorm, LN(word + position + type embeddings). megatron-core has no switch for it (its
  `apply_residual_connection_post_layernorm` is read nowhere in 0.16), so the layer's two
  bias-dropout-add slots normalise their sums here, and the embedding gets a LayerNorm.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import megatron.core.models.bert.bert_lm_head as bert_lm_head
import megatron.core.transformer.transformer_block as transformer_block
import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.datasets.bert_dataset import (
    BERTMaskedWordPieceDataset,
    BERTMaskedWordPieceDatasetConfig,
)
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

from launcher_scripts.jobs.models import bert_hf, transformer
from launcher_scripts.jobs.models.base import ModelRuntime
from launcher_scripts.jobs.models.transformer import LocalNorm
from launcher_scripts.jobs.training import data
from launcher_scripts.jobs.training.runtime import JobError

BATCH_KEYS = ("text", "types", "labels", "loss_mask", "padding_mask", "is_random")
SPECIALS = ("[PAD]", "[CLS]", "[SEP]", "[MASK]")


class WordPieceVocab:
    """What megatron-core's BERT dataset reads of a tokenizer, from a WordPiece vocab.txt: the
    special ids, every id's text ("##" marks a word's continuation, for whole-word masking; the
    ids are also the pool random replacements are drawn from) and a cache key."""

    def __init__(self, vocab_file: str) -> None:
        path = Path(vocab_file)
        tokens = path.read_text(encoding="utf-8").splitlines()
        self.vocab = {token: index for index, token in enumerate(tokens)}
        missing = [token for token in SPECIALS if token not in self.vocab]
        if missing:
            raise JobError(
                f"training.model.tokenizer.vocab_file: {path} has no {', '.join(missing)}: "
                "give a BERT WordPiece vocab.txt (data_preparation's wordpiece one has them)"
            )
        if self.vocab["[PAD]"] != 0:
            # The dataset pads with 0 and megatron-core's masks take id 0 for padding.
            raise JobError(
                f"training.model.tokenizer.vocab_file: [PAD] is line {self.vocab['[PAD]'] + 1} "
                f"of {path}, not the first: put it first (BERT's vocabularies have it there)"
            )
        self.inv_vocab = dict(enumerate(tokens))
        self.vocab_size = len(tokens)
        self.pad, self.cls, self.sep, self.mask = (self.vocab[t] for t in SPECIALS)
        digest = hashlib.sha256("\n".join(tokens).encode()).hexdigest()[:16]
        self.unique_identifiers = {"class": "WordPieceVocab", "vocab": digest}


def data_tokenizer(cfg: Any) -> WordPieceVocab:
    return WordPieceVocab(str(cfg.model.tokenizer.vocab_file))


def build_datasets(
    cfg: Any, vocab: WordPieceVocab, samples: tuple[int, int, int], cache_dir: Path
) -> tuple[Any, Any, Any]:
    """Samples of whole sentences of one document: [CLS] A [SEP] B [SEP], B swapped with A at
    random when the binary head predicts sentence order; 15% (masked_lm_prob) of the tokens,
    whole words, masked (80% [MASK], 10% random, 10% kept), as Megatron's BERT pretraining."""
    data_cfg = cfg.model.data
    return data.build_splits(
        cfg,
        BERTMaskedWordPieceDataset,
        BERTMaskedWordPieceDatasetConfig,
        vocab,
        samples,
        cache_dir,
        masking_probability=float(data_cfg.masked_lm_prob),
        short_sequence_probability=float(data_cfg.get("short_seq_prob", 0.1)),
        masking_max_ngram=3,
        masking_do_full_word=True,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False,
        classification_head=binary_head(cfg),
    )


def binary_head(cfg: Any) -> bool:
    return bool(cfg.model.get("bert_binary_head", True))


def transformer_config(cfg: Any, use_te: bool, on_gpu: bool) -> TransformerConfig:
    config = transformer.transformer_config(cfg, use_te, on_gpu)
    # The masked-LM loss is a mean over each micro-batch's masked tokens and the sentence-order
    # loss a mean over its samples (Megatron's BERT): the schedule averages micro-batches.
    config.calculate_per_token_loss = False
    return config


class PostLayerNormAdd(torch.nn.Module):
    """A bias-dropout-add slot of megatron-core's TransformerLayer that normalises its sum:
    LN(residual + dropout(x + bias)). With identity pre-norms the layer is post-LN BERT."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.norm = LocalNorm(config, config.hidden_size, config.layernorm_epsilon)

    def forward(self, training: bool, fused: bool) -> Any:
        add = get_bias_dropout_add(training, fused)
        return lambda x_with_bias, residual, prob: self.norm(add(x_with_bias, residual, prob))


def layer_spec(cfg: Any, config: TransformerConfig) -> ModuleSpec:
    spec = ModuleSpec(
        module=bert_layer_local_spec.module,
        submodules=type(bert_layer_local_spec.submodules)(**vars(bert_layer_local_spec.submodules)),
    )
    if str(cfg.model.get("transformer_block_type", "pre_ln")) == "post_ln":
        post = ModuleSpec(module=PostLayerNormAdd, params={"config": config})
        spec.submodules.input_layernorm = IdentityOp
        spec.submodules.pre_mlp_layernorm = IdentityOp
        spec.submodules.self_attn_bda = post
        spec.submodules.mlp_bda = post
    else:
        spec.submodules.input_layernorm = LocalNorm
        spec.submodules.pre_mlp_layernorm = LocalNorm
    return spec


@contextlib.contextmanager
def local_norms() -> Iterator[None]:
    """The LM head's and the stack's final LayerNorm are not in the layer spec: megatron-core
    takes them from module globals (Transformer Engine's or Apex's when installed, else a
    torch LayerNorm that refuses sequence parallelism). Built as LocalNorm here."""
    saved = bert_lm_head.LNImpl, transformer_block.LayerNormImpl
    bert_lm_head.LNImpl = transformer_block.LayerNormImpl = LocalNorm
    try:
        yield
    finally:
        bert_lm_head.LNImpl, transformer_block.LayerNormImpl = saved


def _normalised_embedding(module: Any, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
    """Post-LN BERT's LN(word + position + type), then the embedding dropout."""
    normalised = module.layernorm(output)
    if module.config.sequence_parallel:
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return module.dropout_after_norm(normalised)
    return module.dropout_after_norm(normalised)


def build_chunks(cfg: Any, config: TransformerConfig, vocab_size: int, use_te: bool) -> list[Any]:
    if use_te:
        raise JobError(
            "training.model.transformer_engine: BERT runs megatron-core's local layers in this "
            "version: set it to False"
        )
    model_cfg = cfg.model
    post_ln = str(model_cfg.get("transformer_block_type", "pre_ln")) == "post_ln"
    vp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vp or 1):
        stage = vp_stage if vp else None
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        with local_norms():
            chunk = BertModel(
                config=config,
                num_tokentypes=2 if binary_head(cfg) else 0,
                transformer_layer_spec=layer_spec(cfg, config),
                vocab_size=transformer.padded_vocab_size(vocab_size, cfg),
                max_sequence_length=int(model_cfg.max_position_embeddings),
                pre_process=first,
                post_process=parallel_state.is_pipeline_last_stage(
                    ignore_virtual=False, vp_stage=stage
                ),
                fp16_lm_cross_entropy=bool(model_cfg.get("fp16_lm_cross_entropy", False)),
                parallel_output=True,
                share_embeddings_and_output_weights=True,
                position_embedding_type=str(
                    model_cfg.get("position_embedding_type", "learned_absolute")
                ),
                add_binary_head=binary_head(cfg),
                vp_stage=stage,
            )
        if post_ln:
            chunk.encoder.final_layernorm = None
            if first:
                embedding = chunk.embedding
                embedding.layernorm = LocalNorm(
                    config, config.hidden_size, config.layernorm_epsilon
                )
                embedding.dropout_after_norm = embedding.embedding_dropout
                embedding.embedding_dropout = torch.nn.Identity()
                embedding.register_forward_hook(_normalised_embedding)
        chunks.append(chunk)
    return chunks


def forward_step(batch: dict[str, Any], chunk: Any) -> tuple[Any, Any]:
    with_head = "is_random" in batch and chunk_has_binary_head(chunk)
    output = chunk(
        batch["text"],
        batch["padding_mask"],  # 1: a token, 0: padding
        tokentype_ids=batch["types"] if with_head else None,
        lm_labels=batch["labels"].clamp(min=0),  # -1 (not masked) is left out by loss_mask
    )
    return output, partial(bert_loss, batch["loss_mask"], batch["is_random"] if with_head else None)


def chunk_has_binary_head(chunk: Any) -> bool:
    inner = chunk
    while hasattr(inner, "module"):
        inner = inner.module
    return bool(getattr(inner, "add_binary_head", False))


def bert_loss(
    loss_mask: torch.Tensor, is_random: torch.Tensor | None, output: Any
) -> tuple[Any, Any]:
    """The mean masked-LM loss over the masked tokens, plus the sentence-order loss."""
    token_losses, order_logits = output
    mask = loss_mask.float()
    loss = (token_losses.float() * mask).sum() / mask.sum().clamp(min=1)
    if is_random is not None and order_logits is not None:
        loss = loss + F.cross_entropy(order_logits.float(), is_random.long())
    return loss, {"lm loss": torch.stack([loss.detach(), torch.ones_like(loss)])}


RUNTIME = ModelRuntime(
    transformer_config=transformer_config,
    build_chunks=build_chunks,
    data_tokenizer=data_tokenizer,
    build_datasets=build_datasets,
    forward_step=forward_step,
    sequence_lengths=lambda cfg: (int(cfg.model.data.seq_length), None),
    batch_keys=BATCH_KEYS,
    to_hf=bert_hf.to_hf,
)
