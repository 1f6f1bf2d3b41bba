"""A T5's full tensors (megatron-core names, layers stacked) as a Hugging Face checkpoint of
T5ForConditionalGeneration or MT5ForConditionalGeneration (T5 v1.1's layout, which the family's
spec checks first).

Two differences in how the two compute the same thing: transformers' T5 attention does not
scale q.k by 1/sqrt(head size) (Mesh TensorFlow folded it into the initialisation), so the
query weights carry megatron-core's scale; and megatron-core interleaves the fused QKV (and the
cross-attention's KV) weights per head, where transformers keeps separate matrices.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from launcher_scripts.families import t5_hf_config
from launcher_scripts.families.t5 import (
    HF_FEED_FORWARD,
    HF_T5_TOKENIZER,
    MT5_CLASS,
    T5,
    hf_architecture,
)
from launcher_scripts.families.t5_hf_config import hf_t5_tokens
from launcher_scripts.formats.safetensors_stream import Reader, StreamedTensor, TensorSource
from launcher_scripts.jobs.models.base import HfImportError, HfModel
from launcher_scripts.jobs.models.hf_common import (
    Piece,
    copied,
    dtype_name,
    head_dims,
    merge_kv,
    merge_qkv,
    split_kv,
    split_qkv,
    stacked,
)


def _attention(
    tensors: dict[str, torch.Tensor], stack: str, i: int, block: Any
) -> dict[str, torch.Tensor]:
    heads, groups, head_dim = head_dims(block)
    scale = query_scale(block)
    layers = f"{stack}.layers."
    q, k, v = split_qkv(
        tensors[f"{layers}self_attention.linear_qkv.weight"][i], heads, groups, head_dim
    )
    return {
        "layer_norm.weight": tensors[f"{layers}self_attention.linear_qkv.layer_norm_weight"][i],
        "SelfAttention.q.weight": q * scale,
        "SelfAttention.k.weight": k,
        "SelfAttention.v.weight": v,
        "SelfAttention.o.weight": tensors[f"{layers}self_attention.linear_proj.weight"][i],
    }


def query_scale(block: Any) -> float:
    """What our attention scales q.k by (softmax_scale; by default 1/sqrt(head size)), which
    transformers' T5 takes in the query weights. An imported model's is 1.0: copied exactly."""
    scale = block.get("softmax_scale")
    return float(scale) if scale is not None else head_dims(block)[2] ** -0.5


def _cross_attention(
    tensors: dict[str, torch.Tensor], i: int, block: Any
) -> dict[str, torch.Tensor]:
    heads, _, head_dim = head_dims(block)
    layers = "decoder.layers."
    k, v = split_kv(tensors[f"{layers}cross_attention.linear_kv.weight"][i], heads, head_dim)
    return {
        "layer_norm.weight": tensors[f"{layers}pre_cross_attn_layernorm.weight"][i],
        "EncDecAttention.q.weight": tensors[f"{layers}cross_attention.linear_q.weight"][i]
        * query_scale(block),
        "EncDecAttention.k.weight": k,
        "EncDecAttention.v.weight": v,
        "EncDecAttention.o.weight": tensors[f"{layers}cross_attention.linear_proj.weight"][i],
    }


def _mlp(
    tensors: dict[str, torch.Tensor], stack: str, i: int, gated: bool
) -> dict[str, torch.Tensor]:
    layers = f"{stack}.layers."
    fc1 = tensors[f"{layers}mlp.linear_fc1.weight"][i]
    state = {
        "layer_norm.weight": tensors[f"{layers}mlp.linear_fc1.layer_norm_weight"][i],
        "DenseReluDense.wo.weight": tensors[f"{layers}mlp.linear_fc2.weight"][i],
    }
    if gated:  # megatron-core's [activated; linear] halves are wi_0 and wi_1
        wi_0, wi_1 = fc1.chunk(2)
        return state | {"DenseReluDense.wi_0.weight": wi_0, "DenseReluDense.wi_1.weight": wi_1}
    return state | {"DenseReluDense.wi.weight": fc1}


def _prefixed(prefix: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"{prefix}{name}": value for name, value in state.items()}


def to_hf(model: Any, tensors: dict[str, torch.Tensor]) -> HfModel:
    from launcher_scripts.jobs.models.t5 import data_tokenizer

    architecture = hf_architecture(model)
    vocab = data_tokenizer(OmegaConf.create({"model": model}))
    encoder, decoder = model.encoder, model.decoder
    feed_forward = HF_FEED_FORWARD[str(encoder.get("activation", "gelu"))]
    gated = feed_forward.startswith("gated-")
    words = tensors["embedding.word_embeddings.weight"]
    heads, _, head_dim = head_dims(encoder)
    tied = bool(model.get("share_decoder_tokens_head_embeddings", True))
    config = {
        "architectures": [architecture.name],
        "model_type": architecture.model_type,
        "vocab_size": int(words.shape[0]),  # with the padding rows: every logit is compared
        "d_model": int(encoder.hidden_size),
        "d_kv": head_dim,
        "d_ff": int(encoder.ffn_hidden_size),
        "num_layers": int(encoder.num_layers),
        "num_decoder_layers": int(decoder.num_layers),
        "num_heads": heads,
        "relative_attention_num_buckets": int(model.get("relative_attention_num_buckets", 32)),
        "relative_attention_max_distance": int(model.get("relative_attention_max_distance", 128)),
        "dropout_rate": 0.0,
        "layer_norm_epsilon": float(encoder.get("layernorm_epsilon", 1e-5)),
        "feed_forward_proj": feed_forward,
        "is_encoder_decoder": True,
        # Whether the decoder's output is scaled by d_model^-0.5 (T5 v1.0's; transformers 5
        # reads it from this key). Whether the output layer is the embedding table is the
        # checkpoint's: an lm_head.weight or none.
        "tie_word_embeddings": model.get("decoder_output_scale") is not None,
        "pad_token_id": vocab.pad,
        "eos_token_id": vocab.eos,
        "decoder_start_token_id": vocab.bos,
        "torch_dtype": dtype_name(words),
    }
    # transformers takes the stacks' embeddings from `shared` (one table for both).
    state = {
        "shared.weight": words,
        "encoder.final_layer_norm.weight": tensors["encoder.final_layernorm.weight"],
        "decoder.final_layer_norm.weight": tensors["decoder.final_layernorm.weight"],
    }
    if tied:
        bias = tensors.get("lm_head.output_layer.bias")
        if bias is not None and bool(bias.any()):
            raise ValueError(
                "lm_head.output_layer.bias is not zero: Hugging Face's T5 output layer has no "
                "bias (train with share_decoder_tokens_head_embeddings=False for an export)"
            )
    else:
        state["lm_head.weight"] = tensors["lm_head.output_layer.weight"]
    for stack in ("encoder", "decoder"):
        # Every self-attention layer adds the bias computed by the first one's table.
        table = tensors[f"{stack}_relative_pos_emb.relative_attention_bias.weight"]
        state[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = table
    for i in range(int(encoder.num_layers)):
        block = f"encoder.block.{i}.layer."
        state |= _prefixed(f"{block}0.", _attention(tensors, "encoder", i, encoder))
        state |= _prefixed(f"{block}1.", _mlp(tensors, "encoder", i, gated))
    for i in range(int(decoder.num_layers)):
        block = f"decoder.block.{i}.layer."
        state |= _prefixed(f"{block}0.", _attention(tensors, "decoder", i, decoder))
        state |= _prefixed(f"{block}1.", _cross_attention(tensors, i, decoder))
        state |= _prefixed(f"{block}2.", _mlp(tensors, "decoder", i, gated))
    return HfModel(config, state, added_tokens=vocab.added)


# ---------------------------------------------------------------------------------------------
# Import: a Hugging Face T5ForConditionalGeneration / MT5ForConditionalGeneration directory.

# Hugging Face's feed_forward_proj -> our activation computing it (see HF_FEED_FORWARD).
FROM_HF_FEED_FORWARD = {
    "relu": "relu",
    "gelu": "gelu",
    "gated-gelu": "geglu-tanh",  # transformers maps it to gelu_new, the tanh approximation
    "gated-gelu_new": "geglu-tanh",
    "gated-gelu_python": "geglu",
    "gated-silu": "swiglu",
    "gated-relu": "reglu",
}


def from_hf(
    config: dict[str, Any],
    source: TensorSource,
    tokenizer: dict[str, Any],
    lengths: dict[str, int],
) -> tuple[dict[str, Any], list[StreamedTensor]]:
    """(our model section, our full tensors, made a layer at a time) of a T5 checkpoint
    (`source`: its safetensors files); `tokenizer` is our tokenizer section for its files;
    `lengths`: the encoder's and decoder's sequence lengths and the positions.

    Exact, not approximate: transformers' attention does not scale q.k, so the model keeps
    softmax_scale 1.0 (the query weights are copied as they are), and T5 v1.0's one table for
    the embedding and the output layer scales the decoder's output by d_model^-0.5
    (decoder_output_scale)."""
    feed_forward = str(config.get("feed_forward_proj", "relu"))
    if feed_forward not in FROM_HF_FEED_FORWARD:
        raise HfImportError(
            f"config.json feed_forward_proj {feed_forward!r}: this version imports "
            f"{', '.join(FROM_HF_FEED_FORWARD)}"
        )
    if not config.get("is_encoder_decoder", True):
        raise HfImportError("config.json is_encoder_decoder is false: not a T5 encoder-decoder")
    # T5 v1.0 scales the decoder's output by d_model^-0.5; v1.1 and mT5 do not. transformers 4
    # wrote that as tie_word_embeddings, 5 as scale_decoder_outputs (its MT5 never scales).
    # Whether the output layer is the embedding table is the checkpoint's: an lm_head.weight.
    scaled = config.get("model_type") != MT5_CLASS.model_type and bool(
        config.get("scale_decoder_outputs", config.get("tie_word_embeddings", True))
    )
    tied = "lm_head.weight" not in source
    hidden, heads, head_dim = int(config["d_model"]), int(config["num_heads"]), int(config["d_kv"])
    layers = {"encoder": int(config["num_layers"])}
    layers["decoder"] = int(config.get("num_decoder_layers") or layers["encoder"])
    positions = int(lengths["positions"])

    def block(stack: str) -> dict[str, Any]:
        return {
            "num_layers": layers[stack],
            "hidden_size": hidden,
            "ffn_hidden_size": int(config["d_ff"]),
            "num_attention_heads": heads,
            "kv_channels": head_dim,
            "init_method_std": 0.02,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            "position_embedding_type": "relative",
            "relative_attention_num_buckets": int(config["relative_attention_num_buckets"]),
            "relative_attention_max_distance": int(config["relative_attention_max_distance"]),
            "relative_position_bias_self_attention_only": True,
            "apply_query_key_layer_scaling": False,
            "layernorm_epsilon": float(config.get("layer_norm_epsilon", 1e-6)),
            "bias": False,
            "normalization": "rmsnorm",
            "activation": FROM_HF_FEED_FORWARD[feed_forward],
            "transformer_block_type": "pre_ln",
            "softmax_scale": 1.0,
        }

    model = {
        "model_family": T5.name,
        "precision": 32,
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "pipeline_model_parallel_split_rank": 0,
        "seq_length": int(lengths["seq_length"]),
        "max_position_embeddings": positions,
        "position_embedding_type": "relative",
        "relative_attention_num_buckets": int(config["relative_attention_num_buckets"]),
        "relative_attention_max_distance": int(config["relative_attention_max_distance"]),
        "make_vocab_size_divisible_by": 1,
        "share_token_embeddings": True,
        "share_decoder_tokens_head_embeddings": tied,
        "decoder_output_scale": hidden**-0.5 if scaled else None,
        "encoder": block("encoder"),
        "decoder": block("decoder"),
        "tokenizer": tokenizer,
        "data": {
            "seq_length": int(lengths["seq_length"]),
            "seq_length_dec": int(lengths["seq_length_dec"]),
        },
        "transformer_engine": False,
        "hf_architecture": (config.get("architectures") or [None])[0],
    }
    whole = {
        "embedding.word_embeddings.weight": "shared.weight",
        "encoder.final_layernorm.weight": "encoder.final_layer_norm.weight",
        "decoder.final_layernorm.weight": "decoder.final_layer_norm.weight",
    }
    for stack in ("encoder", "decoder"):
        table = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        whole[f"{stack}_relative_pos_emb.relative_attention_bias.weight"] = table
    if not tied:
        whole["lm_head.output_layer.weight"] = "lm_head.weight"
    tensors = copied(source, whole)
    if tied:
        # megatron-core's shared output layer has a bias; Hugging Face's has none.
        words = source.meta("shared.weight")
        zeros = torch.zeros(words.shape[0], dtype=words.dtype)
        tensors.append(StreamedTensor.whole("lm_head.output_layer.bias", zeros))
    gated = feed_forward.startswith("gated-")
    for stack in ("encoder", "decoder"):
        tensors += stacked(source, _layer_pieces(stack, heads, head_dim, gated), layers[stack])
    return model, tensors


def _layer_pieces(stack: str, heads: int, head_dim: int, gated: bool) -> dict[str, Piece]:
    """Each of a stack's layer tensors under our names, as a function of (read, layer)."""
    ours = f"{stack}.layers."
    feed = 2 if stack == "decoder" else 1

    def fetch(name: str) -> Piece:
        return lambda read, i: read(f"{stack}.block.{i}.layer.{name}")

    def qkv(read: Reader, i: int) -> torch.Tensor:
        q, k, v = (read(f"{stack}.block.{i}.layer.0.SelfAttention.{n}.weight") for n in "qkv")
        return merge_qkv(q, k, v, heads, heads, head_dim)

    def fc1(read: Reader, i: int) -> torch.Tensor:
        if not gated:
            return read(f"{stack}.block.{i}.layer.{feed}.DenseReluDense.wi.weight")
        # wi_0 is activated, wi_1 linear: megatron-core's [activated; linear] halves
        halves = (
            read(f"{stack}.block.{i}.layer.{feed}.DenseReluDense.wi_{n}.weight") for n in (0, 1)
        )
        return torch.cat(list(halves))

    def kv(read: Reader, i: int) -> torch.Tensor:
        k, v = (read(f"{stack}.block.{i}.layer.1.EncDecAttention.{n}.weight") for n in "kv")
        return merge_kv(k, v, heads, head_dim)

    pieces: dict[str, Piece] = {
        f"{ours}self_attention.linear_qkv.layer_norm_weight": fetch("0.layer_norm.weight"),
        f"{ours}self_attention.linear_qkv.weight": qkv,
        f"{ours}self_attention.linear_proj.weight": fetch("0.SelfAttention.o.weight"),
        f"{ours}mlp.linear_fc1.layer_norm_weight": fetch(f"{feed}.layer_norm.weight"),
        f"{ours}mlp.linear_fc1.weight": fc1,
        f"{ours}mlp.linear_fc2.weight": fetch(f"{feed}.DenseReluDense.wo.weight"),
    }
    if stack == "decoder":
        pieces |= {
            f"{ours}pre_cross_attn_layernorm.weight": fetch("1.layer_norm.weight"),
            f"{ours}cross_attention.linear_q.weight": fetch("1.EncDecAttention.q.weight"),
            f"{ours}cross_attention.linear_kv.weight": kv,
            f"{ours}cross_attention.linear_proj.weight": fetch("1.EncDecAttention.o.weight"),
        }
    return pieces


def import_hf(
    directory: Path, config: dict[str, Any], source: TensorSource, settings: Any
) -> tuple[dict[str, Any], list[StreamedTensor]]:
    """The T5 family's import (ModelFamily.hf_importer): the directory's tokenizer
    (tokenizer.json, else spiece.model) goes with the model, its ids unchanged; the lengths
    come from the recipe, else the tokenizer."""
    tokenizer_file = t5_hf_config.tokenizer_file(directory)
    # The family's check (the job's and preflight's) compared them with the embedding's rows.
    names = hf_t5_tokens(tokenizer_file)
    positions = settings.get("max_position_embeddings")
    if positions is None:
        stated = _tokenizer_settings(directory).get("model_max_length")
        positions = stated if isinstance(stated, int) and stated < 100_000 else 512
    tokenizer = {
        "library": "huggingface",
        "type": HF_T5_TOKENIZER,
        "model": str(tokenizer_file),
        "vocab_file": None,
        "merge_file": None,
        "num_sentinel_tokens": sum(1 for name in names if name.startswith("<extra_id_")),
    }
    lengths = {
        "positions": int(positions),
        "seq_length": int(settings.get("seq_length") or positions),
        "seq_length_dec": int(settings.get("seq_length_dec") or 128),
    }
    return from_hf(config, source, tokenizer, lengths)


def _tokenizer_settings(directory: Path) -> dict[str, Any]:
    path = directory / "tokenizer_config.json"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}
