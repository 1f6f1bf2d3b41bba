"""T5's and mT5's torch side: megatron-core's T5Model trained on span corruption
(T5MaskedWordPieceDataset) over sentence-split data.

The vocabulary is the tokenizer's plus what span corruption needs past it: for a WordPiece
vocab.txt (T5) [BOS] and [EOS] (the decoder's first input and the targets' end), for a
SentencePiece model (mT5) [CLS], [SEP] and [MASK]; then `num_sentinel_tokens` sentinels
<extra_id_0>, <extra_id_1>, ... that stand for the masked spans. Id 0 must be the padding
(megatron-core's T5 masks take id 0 for it).

megatron-core's local T5 specs need three things on a machine without Transformer Engine or
Apex: their block-level final norm is Transformer Engine's (None without it: the stack would
silently have no final LayerNorm), their layer norms are torch's (no sequence parallelism), and
their attention refuses the relative position bias. All three are LocalNorm / a biased local
attention here.

Pipeline parallelism: megatron-core 0.16's schedule hands one tensor from stage to stage, so
the encoder runs on the stages before `pipeline_model_parallel_split_rank`, each passing its
hidden states on, and the whole decoder on the last stage, which receives the encoder's output
(the recipe check allows no other split). Tables that both sides need (the word and position
embeddings; the encoder's relative bias on each encoder stage) are copies with one initial
value: their gradients are summed over the stages holding them (`finalize_grads`), the gradient
norm counts the first copy only, and the checkpoint stores the first copy (`T5Stage`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.datasets.t5_dataset import (
    T5MaskedWordPieceDataset,
    T5MaskedWordPieceDatasetConfig,
)
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.models.T5 import T5Model
from megatron.core.models.T5.t5_spec import (
    decoder_model_with_local_spec,
    encoder_model_with_local_spec,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from omegaconf import OmegaConf

from launcher_scripts.families.t5 import HF_T5_TOKENIZER, masked_tokens_at_most
from launcher_scripts.families.t5_hf_config import SENTINEL, hf_t5_tokens
from launcher_scripts.jobs.models import t5_hf, t5_tuning, transformer
from launcher_scripts.jobs.models.base import ModelRuntime, token_loss
from launcher_scripts.jobs.models.t5_masks import attention_masks
from launcher_scripts.jobs.models.transformer import LocalNorm
from launcher_scripts.jobs.training import data
from launcher_scripts.jobs.training.checkpointing import unwrap
from launcher_scripts.jobs.training.runtime import JobError
from launcher_scripts.recipes.layout import read_layout
from launcher_scripts.recipes.training import encoder_decoder_split

BATCH_KEYS = ("text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask")
TOKENIZER_KEY = "training.model.tokenizer"


class SpanCorruptionVocab:
    """What megatron-core's T5 dataset reads of a tokenizer: special ids, the sentinels, every
    id's text ("##" marks a word's continuation, for whole-word masking) and a cache key."""

    def __init__(
        self,
        tokens: list[str],
        continuation: list[bool],
        extra: list[str],
        source: str,
        decoder_start_is_pad: bool = False,
    ):
        # <extra_id_0>, <extra_id_1>, ... in that order, wherever their ids are.
        sentinels = sorted(
            (token for token in extra if token.startswith("<extra_id_")),
            key=lambda token: int(token.removeprefix("<extra_id_").removesuffix(">")),
        )
        names = tokens + extra
        self.vocab = {token: index for index, token in enumerate(names)}
        self.inv_vocab = {
            index: ("##" + token if index < len(tokens) and continuation[index] else token)
            for index, token in enumerate(names)
        }
        self.vocab_size = len(names)
        self.source = source
        self.pad = 0
        if decoder_start_is_pad:
            # Hugging Face's T5 layout: no [BOS], [CLS], [SEP] or [MASK]; the decoder starts
            # at the padding id (t5_masks.py keeps that position attended).
            self.bos, self.cls, self.sep, self.mask = self.pad, None, None, None
            (self.eos,) = (self.vocab[t] for t in self.specials("eos"))
        else:
            self.cls, self.sep, self.mask = (self.vocab[t] for t in self.specials("cls sep mask"))
            self.bos, self.eos = (self.vocab[t] for t in self.specials("bos eos"))
        self.additional_special_tokens_ids = [self.vocab[t] for t in sentinels]
        digest = hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]
        self.unique_identifiers = {"class": "SpanCorruptionVocab", "vocab": digest}
        self.added = tuple(extra)  # the tokens past the tokenizer's own, in id order

    def specials(self, names: str) -> list[str]:
        found = []
        for name in names.split():
            candidates = [f"[{name.upper()}]", f"<{name}>", f"<{name.upper()}>"]
            candidates += {"bos": ["<s>"], "eos": ["</s>"]}.get(name, [])
            match = next((c for c in candidates if c in self.vocab), None)
            if match is None:
                raise JobError(f"{TOKENIZER_KEY}: {self.source} has no {name} token")
            found.append(match)
        return found


def _wordpiece(vocab_file: Path, sentinels: int) -> SpanCorruptionVocab:
    tokens = vocab_file.read_text(encoding="utf-8").splitlines()
    if not tokens or tokens[0] != "[PAD]":
        raise JobError(
            f"{TOKENIZER_KEY}.vocab_file: the first line of {vocab_file} is not [PAD]: T5's "
            "padding is id 0 (data_preparation's wordpiece vocabulary has it there)"
        )
    extra = [t for t in ("[BOS]", "[EOS]") if t not in tokens]
    extra += [SENTINEL.format(i) for i in range(sentinels)]
    continuation = [token.startswith("##") for token in tokens]
    tokens = [token.removeprefix("##") for token in tokens]
    return SpanCorruptionVocab(tokens, continuation, extra, str(vocab_file))


def _sentencepiece(model_file: Path, sentinels: int) -> SpanCorruptionVocab:
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    if processor.pad_id() != 0:
        raise JobError(
            f"{TOKENIZER_KEY}.model: {model_file} pads with id {processor.pad_id()}, not 0: "
            "train it with pad_id=0 (data_preparation's train_tokenizer_args do)"
        )
    tokens = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
    tokens[0], tokens[processor.bos_id()], tokens[processor.eos_id()] = "<pad>", "<s>", "</s>"
    # A piece that does not start a word (no "▁") continues the one before it.
    continuation = [
        not (token.startswith("▁") or processor.is_control(i) or processor.is_unknown(i))
        for i, token in enumerate(tokens)
    ]
    extra = ["[CLS]", "[SEP]", "[MASK]", *(SENTINEL.format(i) for i in range(sentinels))]
    return SpanCorruptionVocab(tokens, continuation, extra, str(model_file))


def _hf_t5(model_file: Path) -> SpanCorruptionVocab:
    """Hugging Face's T5 tokenizer and its ids (an imported model's): its tokenizer.json (or a
    SentencePiece model alone), padding 0 and end 1, <extra_id_N> at the vocabulary's end in
    reverse order (<extra_id_0> last)."""
    names = hf_t5_tokens(model_file)
    sentinels = sum(1 for name in names if name.startswith("<extra_id_"))
    own = names[: len(names) - sentinels]
    if own[0] != "<pad>" or "</s>" not in own:
        raise JobError(
            f"{TOKENIZER_KEY}.model: {model_file} does not pad with id 0 or has no </s>: not "
            "a T5 tokenizer"
        )
    continuation = [
        not (token.startswith("▁") or (token.startswith("<") and token.endswith(">")))
        for token in own
    ]
    return SpanCorruptionVocab(
        own, continuation, names[len(own) :], str(model_file), decoder_start_is_pad=True
    )


def data_tokenizer(cfg: Any) -> SpanCorruptionVocab:
    tokenizer = cfg.model.tokenizer
    sentinels = int(tokenizer.get("num_sentinel_tokens") or 0)
    if tokenizer.get("type") == HF_T5_TOKENIZER:  # as imported: its sentinels, if any
        return _hf_t5(Path(str(tokenizer.model)))
    if sentinels < 1:
        raise JobError(
            f"{TOKENIZER_KEY}.num_sentinel_tokens: {sentinels}: span corruption needs a sentinel "
            "per masked span: use e.g. 100"
        )
    if tokenizer.get("model"):
        return _sentencepiece(Path(str(tokenizer.model)), sentinels)
    return _wordpiece(Path(str(tokenizer.vocab_file)), sentinels)


class SpanCorruptionDataset(T5MaskedWordPieceDataset):
    """megatron-core's T5 dataset, whose one reachable assertion (a sample's decoder input
    longer than seq_length_dec: many short spans) is one line naming the key. Preflight
    refuses a length no full sample fits; this is the rarer sample whose spans are short."""

    def __getitem__(self, idx: int) -> dict[str, Any]:
        try:
            return super().__getitem__(idx)
        except AssertionError:
            longest = 1 + 2 * masked_tokens_at_most(
                self.config.masking_probability, self.config.sequence_length
            )
            raise JobError(
                f"training.model.data.seq_length_dec: {self.config.sequence_length_decoder} "
                f"does not hold the decoder input of sample {idx} (a start token, and a "
                f"sentinel and the tokens of each masked span): set it to {longest}, which "
                "holds any sample"
            ) from None


def build_datasets(
    cfg: Any, vocab: SpanCorruptionVocab, samples: tuple[int, int, int], cache_dir: Path
) -> tuple[Any, Any, Any]:
    """Samples of whole sentences of one document, spans of `masked_lm_prob` of the tokens
    (up to `max_ngram_size` long) replaced by sentinels in the encoder's input; the decoder
    reads the sentinels and the spans they replace."""
    if vocab.mask is None:
        raise JobError(
            f"{TOKENIZER_KEY}: {vocab.source} is a Hugging Face T5 tokenizer, which has none of "
            "the [CLS], [SEP] and [MASK] tokens megatron-core's span corruption needs: "
            "fine-tune this model (fine_tuning, peft) rather than pretrain it further"
        )
    data_cfg = cfg.model.data
    return data.build_splits(
        cfg,
        SpanCorruptionDataset,
        T5MaskedWordPieceDatasetConfig,
        vocab,
        samples,
        cache_dir,
        sequence_length_decoder=int(data_cfg.seq_length_dec),
        masking_probability=float(data_cfg.masked_lm_prob),
        short_sequence_probability=float(data_cfg.get("short_seq_prob", 0.0)),
        masking_max_ngram=int(data_cfg.get("max_ngram_size", 10)),
        masking_do_full_word=bool(data_cfg.get("whole_word_masking", True)),
        masking_do_permutation=bool(data_cfg.get("permutation", False)),
        masking_use_longer_ngrams=bool(data_cfg.get("favor_longer_ngrams", False)),
        masking_use_geometric_distribution=bool(data_cfg.get("geometric_dist", True)),
    )


def block_view(cfg: Any, block: str) -> Any:
    """The recipe with `model` replaced by one block's keys over the model's shared ones: what
    the GPT config builder reads (layers, widths, norms, activation) for that stack."""
    shared = {k: v for k, v in cfg.model.items() if k not in ("encoder", "decoder")}
    view = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    view.model = OmegaConf.merge(shared, cfg.model[block])
    return view


def transformer_config(cfg: Any, use_te: bool, on_gpu: bool) -> TransformerConfig:
    """The decoder's config (T5Model's `config`, which the schedule and the optimizer use),
    holding the encoder's as `encoder_config`. Under pipeline parallelism each block's
    `pipeline_model_parallel_size` is the stages it spans (the encoder's before the split rank,
    the decoder's one): megatron-core numbers a stage's layers, and names them in checkpoints,
    from it."""
    config = transformer.transformer_config(block_view(cfg, "decoder"), use_te, on_gpu)
    encoder = transformer.transformer_config(block_view(cfg, "encoder"), use_te, on_gpu)
    pipeline = read_layout(cfg).pipeline
    if pipeline > 1:
        encoder_stages, _ = encoder_decoder_split(cfg.model, pipeline, "training")
        encoder = dataclasses.replace(encoder, pipeline_model_parallel_size=encoder_stages)
        config.pipeline_model_parallel_size = 1  # kept: the schedule's hooks are set on it
    config.encoder_config = encoder
    return config


class BiasedDotProductAttention(DotProductAttention):
    """megatron-core's local attention with an additive bias (T5's relative position bias,
    [1, heads of this rank, sq, sk]): scale x q.k + bias, then the mask and the softmax."""

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is None:
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, None, packed_seq_params
            )
        repeat = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if repeat > 1:
            key = key.repeat_interleave(repeat, dim=2)
            value = value.repeat_interleave(repeat, dim=2)
        length, batch = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
        scores = scores + attention_bias.to(scores.dtype)
        probs = self.scale_mask_softmax(scores, attention_mask, self.softmax_offset)
        if self.config.sequence_parallel:
            probs = self.attention_dropout(probs)
        else:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.attention_dropout(probs)
        context = torch.matmul(probs.to(v.dtype), v).permute(2, 0, 1, 3).contiguous()
        return context.view(length, batch, self.hidden_size_per_partition)


def _local(spec: ModuleSpec) -> ModuleSpec:
    sub = spec.submodules
    sub.input_layernorm = LocalNorm
    sub.pre_mlp_layernorm = LocalNorm
    if sub.pre_cross_attn_layernorm is not IdentityOp:
        sub.pre_cross_attn_layernorm = LocalNorm
    sub.self_attention.submodules.core_attention = BiasedDotProductAttention
    if isinstance(sub.cross_attention, ModuleSpec):
        sub.cross_attention.submodules.core_attention = BiasedDotProductAttention
    return spec


class T5Stage(T5Model):
    """A T5Model on one pipeline stage, which knows the tables it holds as copies of another
    stage's: their checkpoint entries are marked as replicas, so that the first copy is the
    one stored (megatron-core's T5Model marks none)."""

    copies: tuple[str, ...] = ()  # state-dict prefixes of the copied tables
    # (parameter, process group of the stages holding it): gradients summed after each step
    replicated: tuple[tuple[torch.nn.Parameter, Any], ...] = ()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        copied = tuple(prefix + copy for copy in self.copies)
        for name, tensor in state.items():
            if copied and isinstance(tensor, ShardedTensor) and name.startswith(copied):
                rest = tensor.replica_id[1:] if isinstance(tensor.replica_id, tuple) else (0,)
                tensor.replica_id = (1, *rest)
        return state


def _layer_specs(
    spec: ModuleSpec,
    config: TransformerConfig,
    layers: int,
    first: int = 0,
    final_norm: type = LocalNorm,
) -> TransformerBlockSubmodules:
    """The block's `layers` layers from its layer `first` on: Switch-style experts (megatron-
    core's MoELayer) in place of the MLP where the block's moe_layer_freq puts them."""
    dense = _local(spec)
    if not config.num_moe_experts:
        return TransformerBlockSubmodules(layer_specs=[dense] * layers, layer_norm=final_norm)
    moe = _local(copy.deepcopy(spec))
    moe.submodules.mlp = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts)
    transformer.use_local_experts(moe)
    freq = config.moe_layer_freq
    pattern = (
        [int(i % freq == 0) for i in range(config.num_layers)] if isinstance(freq, int) else freq
    )
    chosen = [moe if pattern[first + i] else dense for i in range(layers)]
    return TransformerBlockSubmodules(layer_specs=chosen, layer_norm=final_norm)


def _scaled_norm(scale: float | None) -> type:
    """The decoder's final norm, its output times `scale` when set: T5 v1.0 (one table for the
    embedding and the output layer) scales the decoder's output by d_model^-0.5 before the
    output layer (Hugging Face's T5 does when tie_word_embeddings)."""
    if scale is None:
        return LocalNorm

    class ScaledNorm(LocalNorm):
        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            return super().forward(hidden) * scale

    return ScaledNorm


def build_chunks(
    cfg: Any, config: TransformerConfig, vocab_size: int, use_te: bool
) -> list[T5Model]:
    if use_te:
        raise JobError(
            "training.model.transformer_engine: T5 runs megatron-core's local layers in this "
            "version: set it to False"
        )
    model_cfg = cfg.model
    encoder_config = config.encoder_config
    pipeline = parallel_state.get_pipeline_model_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    encoder_stages = encoder_config.pipeline_model_parallel_size
    on_encoder = pipeline == 1 or stage < encoder_stages
    on_decoder = pipeline == 1 or stage == pipeline - 1
    positions = str(model_cfg.get("position_embedding_type", "learned_absolute"))
    chunk = T5Stage(
        config=config,
        encoder_config=encoder_config,
        transformer_encoder_layer_spec=_layer_specs(
            encoder_model_with_local_spec(),
            encoder_config,
            encoder_config.num_layers // encoder_stages,
            min(stage, encoder_stages - 1) * (encoder_config.num_layers // encoder_stages),
        ),
        transformer_decoder_layer_spec=_layer_specs(
            decoder_model_with_local_spec(),
            config,
            config.num_layers,
            final_norm=_scaled_norm(model_cfg.get("decoder_output_scale")),
        ),
        vocab_size=transformer.padded_vocab_size(vocab_size, cfg),
        max_sequence_length=int(model_cfg.max_position_embeddings),
        # The decoder stage embeds the decoder's tokens.
        pre_process=stage == 0 or on_decoder,
        post_process=on_decoder,
        fp16_lm_cross_entropy=bool(model_cfg.get("fp16_lm_cross_entropy", False)),
        parallel_output=True,
        share_embeddings_and_output_weights=bool(
            model_cfg.get("share_decoder_tokens_head_embeddings", True)
        ),
        position_embedding_type=positions,
        relative_attention_num_buckets=int(model_cfg.get("relative_attention_num_buckets", 32)),
        relative_attention_max_distance=int(model_cfg.get("relative_attention_max_distance", 128)),
        add_encoder=on_encoder,
        add_decoder=on_decoder,
        # T5Model asks for the TP, CP and PP groups only by default; experts need theirs too.
        pg_collection=ProcessGroupCollection.use_mpu_process_groups()
        if config.num_moe_experts or encoder_config.num_moe_experts
        else None,
    )
    if pipeline > 1:
        _split_over_stages(chunk, stage, pipeline, encoder_stages)
    head = getattr(chunk, "lm_head", None)
    if model_cfg.get("hf_architecture") and head is not None and head.output_layer.bias is not None:
        # An imported model's output layer on the embedding table has no bias in Hugging Face's
        # T5: it stays at zero, so that a tuned model exports back.
        head.output_layer.bias.requires_grad_(False)
    return [chunk]


def _split_over_stages(chunk: T5Stage, stage: int, pipeline: int, encoder_stages: int) -> None:
    """Drops the relative bias table of the block a stage does not run, gives the last encoder
    stage the encoder's final norm (megatron-core puts it on the last pipeline stage, which
    holds the decoder here), and lists the tables that are copies of another stage's."""
    copies: list[str] = []
    replicated: list[tuple[torch.nn.Parameter, Any]] = []
    relative = chunk.position_embedding_type == "relative"
    # Created by every rank, the decoder's too (new process groups are collective).
    encoder_group = (
        _encoder_stages_group(encoder_stages) if relative and encoder_stages > 1 else None
    )
    if chunk.add_encoder:
        if relative:
            chunk.decoder_relative_pos_emb = None
        if stage == encoder_stages - 1:
            encoder_config = chunk.encoder_config
            chunk.encoder.final_layernorm = LocalNorm(
                encoder_config, encoder_config.hidden_size, encoder_config.layernorm_epsilon
            )
        if encoder_group is not None:
            replicated += [(p, encoder_group) for p in chunk.encoder_relative_pos_emb.parameters()]
            if stage > 0:
                copies.append("encoder_relative_pos_emb.")
    elif relative:
        chunk.encoder_relative_pos_emb = None
    if chunk.pre_process:
        # megatron-core sums a tied word embedding's gradients itself; an untied one and the
        # learned position table are summed here.
        learned = chunk.position_embeddings is not None
        tables = (
            [] if chunk.share_embeddings_and_output_weights else [chunk.embedding.word_embeddings]
        )
        tables += [chunk.position_embeddings] if learned else []
        group = parallel_state.get_embedding_group()
        replicated += [(p, group) for table in tables for p in table.parameters()]
        if stage == pipeline - 1:
            # T5Model registers the position table twice: also as `position_embeddings`.
            copies += ["embedding.", *(["position_embeddings."] if learned else [])]
    for name in copies:
        for param in getattr(chunk, name.rstrip(".")).parameters():
            param.shared = True  # the gradient norm counts the first copy only
    chunk.copies, chunk.replicated = tuple(copies), tuple(replicated)


def _encoder_stages_group(encoder_stages: int) -> Any:
    """The process group of this rank's encoder stages (the first `encoder_stages` ranks of its
    pipeline group). Every rank creates every such group, in the same order."""
    pipeline_group = parallel_state.get_pipeline_model_parallel_group()
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, dist.get_process_group_ranks(pipeline_group))
    mine = None
    for ranks in sorted({tuple(ranks[:encoder_stages]) for ranks in everyone}):
        group = dist.new_group(list(ranks))
        if dist.get_rank() in ranks:
            mine = group
    return mine


def finalize_grads(model_chunks: list[Any], *args: Any, **kwargs: Any) -> None:
    """megatron-core's gradient finalisation, then the copied tables' gradients summed over
    the stages holding them, so that every copy takes the same optimizer step."""
    finalize_model_grads(model_chunks, *args, **kwargs)
    for chunk in model_chunks:
        for param, group in unwrap(chunk).replicated:
            grad = param.main_grad if hasattr(param, "main_grad") else param.grad
            if grad is not None:
                dist.all_reduce(grad, group=group)


def forward_step(batch: dict[str, Any], chunk: Any) -> tuple[Any, Any]:
    enc_mask, dec_mask, enc_dec_mask = attention_masks(batch["enc_mask"], batch["dec_mask"])
    stage = unwrap(chunk)
    # The decoder stage of a pipeline receives the encoder's output (set_input_tensor): given
    # explicitly, it skips the encoder branch it does not hold.
    received = None if stage.add_encoder else stage.encoder_hidden_state
    output = chunk(
        batch["text_enc"],
        batch["text_dec"],
        enc_mask,
        dec_mask,
        enc_dec_mask,
        lm_labels=batch["labels"].clamp(min=0),  # -1: padding, left out by loss_mask
        encoder_hidden_states=received,
    )
    return output, partial(token_loss, batch["loss_mask"])


RUNTIME = ModelRuntime(
    transformer_config=transformer_config,
    build_chunks=build_chunks,
    data_tokenizer=data_tokenizer,
    build_datasets=build_datasets,
    forward_step=forward_step,
    sequence_lengths=lambda cfg: (int(cfg.model.data.seq_length), None),
    batch_keys=BATCH_KEYS,
    to_hf=t5_hf.to_hf,
    finalize_grads=finalize_grads,
    tuning=t5_tuning.TUNING,
    served=t5_tuning.served,
)
