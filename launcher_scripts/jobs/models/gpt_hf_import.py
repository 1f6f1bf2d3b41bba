"""A Hugging Face decoder-only checkpoint as a GPT: our model section, and our full tensors
(megatron-core's names, layers stacked) made one layer at a time from the checkpoint's.

    LlamaForCausalLM     RMSNorm, SwiGLU, RoPE (rope_theta, Llama 3's rope scaling), GQA
    MistralForCausalLM   Llama's layout (a sliding window is refused: full attention here)
    Qwen2ForCausalLM     Llama's layout with biases on Q, K and V
    StableLmForCausalLM  LayerNorm, SwiGLU, partial RoPE, optional Q/K/V biases
    GPT2LMHeadModel      LayerNorm, GeLU (exact or tanh), learned positions, biases everywhere

A setting that changes what the model computes and that megatron-core's GPT cannot compute the
same way is refused in one line naming the config.json field; nothing is approximated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from launcher_scripts.families.gpt_architectures import (
    GPT2,
    LLAMA,
    MISTRAL,
    QWEN2,
    STABLELM,
)
from launcher_scripts.formats.safetensors_stream import Reader, StreamedTensor, TensorSource
from launcher_scripts.jobs.models.base import HfImportError
from launcher_scripts.jobs.models.gpt_hf import LLAMA3_ORIGINAL_POSITIONS, LLAMA3_ROPE
from launcher_scripts.jobs.models.hf_common import Piece, copied, merge_qkv, stacked

LAYERS = "decoder.layers."
ROTARY_TYPES = (LLAMA.model_type, MISTRAL.model_type, QWEN2.model_type, STABLELM.model_type)
MODEL_TYPES = (*ROTARY_TYPES, GPT2.model_type)
# transformers' activation names -> ours (GPT-2's activation_function)
GPT2_ACTIVATIONS = {"gelu_new": "gelu-tanh", "gelu_pytorch_tanh": "gelu-tanh", "gelu": "gelu"}
PRECISIONS = {"float32": 32, "bfloat16": "bf16", "float16": 16}


def refuse(field: str, value: Any, why: str) -> HfImportError:
    return HfImportError(f"config.json {field} {value!r}: {why}")


def _require(config: dict[str, Any], field: str, wanted: Any, why: str) -> None:
    value = config.get(field, wanted)
    if value != wanted:
        raise refuse(field, value, why)


def rope_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The rotary settings: transformers 4 writes rope_theta, rope_scaling and
    partial_rotary_factor at the top, transformers 5 in rope_parameters."""
    settings = dict(config.get("rope_parameters") or {})
    settings |= dict(config.get("rope_scaling") or {})
    for field in ("rope_theta", "partial_rotary_factor"):
        if field in config:
            settings[field] = config[field]
    return settings


def rope_scaling_factor(settings: dict[str, Any]) -> float | None:
    """Llama 3's rope scaling as megatron-core computes it (its factor; the low and high
    frequency factors and the original length fixed at Llama 3.1's), or None for none."""
    kind = settings.get("rope_type", settings.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise refuse("rope_scaling.rope_type", kind, "this version computes Llama 3's only")
    expected = {**LLAMA3_ROPE, "original_max_position_embeddings": LLAMA3_ORIGINAL_POSITIONS}
    for field, wanted in expected.items():
        if float(settings.get(field, wanted)) != float(wanted):
            raise refuse(
                f"rope_scaling.{field}",
                settings.get(field),
                f"megatron-core's Llama 3 scaling is fixed at {wanted:g}",
            )
    return float(settings["factor"])


def _check_rotary(config: dict[str, Any], model_type: str) -> None:
    _require(config, "hidden_act", "silu", "this version imports SwiGLU (silu) models")
    if model_type == LLAMA.model_type:
        for field in ("attention_bias", "mlp_bias"):
            _require(config, field, False, "biases on Llama's projections are not imported")
    window = config.get("sliding_window")
    windowed = (
        bool(config.get("use_sliding_window", False))
        if model_type == QWEN2.model_type
        else window is not None and int(window) < int(config["max_position_embeddings"])
    )
    if windowed:
        raise refuse(
            "sliding_window",
            window,
            "sliding-window attention is not imported (every position attends to all before it)",
        )
    if model_type == STABLELM.model_type:
        for field in ("qk_layernorm", "use_parallel_residual"):
            _require(config, field, False, "this version imports StableLM without it")


def rotary_section(config: dict[str, Any]) -> dict[str, Any]:
    model_type = config["model_type"]
    _check_rotary(config, model_type)
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    positions = int(config["max_position_embeddings"])
    stablelm = model_type == STABLELM.model_type
    qkv_bias = model_type == QWEN2.model_type or bool(config.get("use_qkv_bias", False))
    rope = rope_settings(config)
    return {
        "num_layers": int(config["num_hidden_layers"]),
        "hidden_size": hidden,
        "ffn_hidden_size": int(config["intermediate_size"]),
        "num_attention_heads": heads,
        "num_query_groups": int(config.get("num_key_value_heads") or heads),
        "kv_channels": int(config.get("head_dim") or hidden // heads),
        "max_position_embeddings": positions,
        "position_embedding_type": "rope",
        "rotary_percentage": float(rope.get("partial_rotary_factor", 1.0)),
        "rotary_base": float(rope.get("rope_theta", 10000.0)),
        "rope_scaling_factor": rope_scaling_factor(rope),
        "normalization": "layernorm" if stablelm else "rmsnorm",
        "layernorm_epsilon": float(config["layer_norm_eps" if stablelm else "rms_norm_eps"]),
        "activation": "swiglu",
        "bias": False,
        "qkv_bias": qkv_bias,
        "init_method_std": float(config.get("initializer_range", 0.02)),
    }


def gpt2_section(config: dict[str, Any]) -> dict[str, Any]:
    activation = config.get("activation_function", "gelu_new")
    if activation not in GPT2_ACTIVATIONS:
        raise refuse(
            "activation_function", activation, f"this version imports {', '.join(GPT2_ACTIVATIONS)}"
        )
    _require(config, "scale_attn_weights", True, "attention without 1/sqrt(head size)")
    _require(config, "scale_attn_by_inverse_layer_idx", False, "not computed by megatron-core")
    _require(config, "add_cross_attention", False, "a decoder-only GPT has no cross-attention")
    hidden, heads = int(config["n_embd"]), int(config["n_head"])
    return {
        "num_layers": int(config["n_layer"]),
        "hidden_size": hidden,
        "ffn_hidden_size": int(config.get("n_inner") or 4 * hidden),
        "num_attention_heads": heads,
        "num_query_groups": heads,
        "kv_channels": hidden // heads,
        "max_position_embeddings": int(config["n_positions"]),
        "position_embedding_type": "learned_absolute",
        "normalization": "layernorm",
        "layernorm_epsilon": float(config.get("layer_norm_epsilon", 1e-5)),
        "activation": GPT2_ACTIVATIONS[activation],
        "bias": True,
        "qkv_bias": False,
        "init_method_std": float(config.get("initializer_range", 0.02)),
    }


# ----- tensors ----------------------------------------------------------------------------
# Each of ours is made by a function of (read, layer), read giving a checkpoint tensor by name;
# run on meta tensors first, for the shapes the file's header needs.


def prefixed(per_layer: dict[str, Piece]) -> dict[str, Piece]:
    return {f"{LAYERS}{name}": piece for name, piece in per_layer.items()}


def rotary_tensors(
    source: TensorSource, section: dict[str, Any], tied: bool
) -> list[StreamedTensor]:
    heads, groups = section["num_attention_heads"], section["num_query_groups"]
    channels, ffn = section["kv_channels"], section["ffn_hidden_size"]
    bias = section["normalization"] == "layernorm"  # StableLM's LayerNorm has a bias
    layer = "model.layers.{}."

    def fetch(name: str) -> Piece:
        return lambda read, i: read(layer.format(i) + name)

    def fused(kind: str) -> Piece:
        def piece(read: Reader, i: int) -> torch.Tensor:
            q, k, v = (read(f"{layer.format(i)}self_attn.{p}_proj.{kind}") for p in "qkv")
            return merge_qkv(q, k, v, heads, groups, channels)

        return piece

    def fc1(read: Reader, i: int) -> torch.Tensor:  # [gate; up]: megatron's SwiGLU halves
        gate, up = (read(f"{layer.format(i)}mlp.{p}_proj.weight") for p in ("gate", "up"))
        assert gate.shape[0] == ffn, gate.shape
        return torch.cat([gate, up])

    per_layer: dict[str, Piece] = {
        "self_attention.linear_qkv.layer_norm_weight": fetch("input_layernorm.weight"),
        "self_attention.linear_qkv.weight": fused("weight"),
        "self_attention.linear_proj.weight": fetch("self_attn.o_proj.weight"),
        "mlp.linear_fc1.layer_norm_weight": fetch("post_attention_layernorm.weight"),
        "mlp.linear_fc1.weight": fc1,
        "mlp.linear_fc2.weight": fetch("mlp.down_proj.weight"),
    }
    if bias:
        per_layer["self_attention.linear_qkv.layer_norm_bias"] = fetch("input_layernorm.bias")
        per_layer["mlp.linear_fc1.layer_norm_bias"] = fetch("post_attention_layernorm.bias")
    if section["qkv_bias"]:
        per_layer["self_attention.linear_qkv.bias"] = fused("bias")
    whole: dict[str, str] = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
    }
    if bias:
        whole["decoder.final_layernorm.bias"] = "model.norm.bias"
    if not tied:
        whole["output_layer.weight"] = "lm_head.weight"
    return copied(source, whole) + stacked(source, prefixed(per_layer), section["num_layers"])


def gpt2_tensors(source: TensorSource, section: dict[str, Any], tied: bool) -> list[StreamedTensor]:
    prefix = "transformer." if "transformer.wte.weight" in source else ""
    layer = prefix + "h.{}."
    heads, channels = section["num_attention_heads"], section["kv_channels"]

    def fetch(name: str, transpose: bool = False) -> Piece:
        # GPT-2's Conv1D keeps a weight as [in, out]: the transpose of a Linear's.
        def piece(read: Reader, i: int) -> torch.Tensor:
            tensor = read(layer.format(i) + name)
            return tensor.t().contiguous() if transpose else tensor

        return piece

    def fused(kind: str) -> Piece:
        def piece(read: Reader, i: int) -> torch.Tensor:
            tensor = read(f"{layer.format(i)}attn.c_attn.{kind}")
            q, k, v = (tensor.t() if kind == "weight" else tensor).chunk(3)
            return merge_qkv(q, k, v, heads, heads, channels)

        return piece

    per_layer: dict[str, Piece] = {
        "self_attention.linear_qkv.layer_norm_weight": fetch("ln_1.weight"),
        "self_attention.linear_qkv.layer_norm_bias": fetch("ln_1.bias"),
        "self_attention.linear_qkv.weight": fused("weight"),
        "self_attention.linear_qkv.bias": fused("bias"),
        "self_attention.linear_proj.weight": fetch("attn.c_proj.weight", transpose=True),
        "self_attention.linear_proj.bias": fetch("attn.c_proj.bias"),
        "mlp.linear_fc1.layer_norm_weight": fetch("ln_2.weight"),
        "mlp.linear_fc1.layer_norm_bias": fetch("ln_2.bias"),
        "mlp.linear_fc1.weight": fetch("mlp.c_fc.weight", transpose=True),
        "mlp.linear_fc1.bias": fetch("mlp.c_fc.bias"),
        "mlp.linear_fc2.weight": fetch("mlp.c_proj.weight", transpose=True),
        "mlp.linear_fc2.bias": fetch("mlp.c_proj.bias"),
    }
    whole = {
        "embedding.word_embeddings.weight": f"{prefix}wte.weight",
        "embedding.position_embeddings.weight": f"{prefix}wpe.weight",
        "decoder.final_layernorm.weight": f"{prefix}ln_f.weight",
        "decoder.final_layernorm.bias": f"{prefix}ln_f.bias",
    }
    if not tied:
        whole["output_layer.weight"] = "lm_head.weight"
    return copied(source, whole) + stacked(source, prefixed(per_layer), section["num_layers"])


# ----- the tokenizer ----------------------------------------------------------------------


def tokenizer_section(directory: Path) -> dict[str, Any]:
    """The directory's tokenizer, ids unchanged: tokenizer.json where there is one, else a
    SentencePiece tokenizer.model, else GPT-2's vocab.json and merges.txt. Documents end with
    the model's end-of-sequence token."""
    eos = _eos_token(directory)
    files = {name: directory / name for name in ("tokenizer.json", "tokenizer.model")}
    settings = directory / "tokenizer_config.json"
    section = {"library": None, "type": None, "model": None, "vocab_file": None}
    section |= {"merge_file": None, "delimiter": None, "eod_token": eos}
    section["hf_config"] = str(settings) if settings.is_file() else None
    if files["tokenizer.json"].is_file():
        return section | {"library": "huggingface", "model": str(files["tokenizer.json"])}
    if files["tokenizer.model"].is_file():
        return section | {"library": "sentencepiece", "model": str(files["tokenizer.model"])}
    vocab, merges = directory / "vocab.json", directory / "merges.txt"
    if vocab.is_file() and merges.is_file():
        return section | {
            "library": "megatron",
            "type": "GPT2BPETokenizer",
            "vocab_file": str(vocab),
            "merge_file": str(merges),
        }
    raise HfImportError(
        f"{directory} has no tokenizer.json, tokenizer.model, or vocab.json with merges.txt: "
        "save the model's tokenizer there (tokenizer.save_pretrained)"
    )


def _eos_token(directory: Path) -> str | None:
    """The end-of-sequence token's text, from tokenizer_config.json (or special_tokens_map)."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            settings = json.loads((directory / name).read_text())
        except (OSError, ValueError):
            continue
        token = settings.get("eos_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            return token
    return None


# ----- the whole import -------------------------------------------------------------------


def import_hf(
    directory: Path, config: dict[str, Any], source: TensorSource, settings: Any
) -> tuple[dict[str, Any], list[StreamedTensor]]:
    """ModelRuntime.from_hf for the GPT family: (our model section, our tensors)."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise refuse("model_type", model_type, f"the GPT family imports {', '.join(MODEL_TYPES)}")
    gpt2 = model_type == GPT2.model_type
    section = gpt2_section(config) if gpt2 else rotary_section(config)
    # Whether the output layer is the embedding table: the checkpoint's own lm_head, or none.
    tied = "lm_head.weight" not in source
    if not tied and bool(config.get("tie_word_embeddings", False)):
        tied = True  # a copy of the table written beside it; the config says they are one
    positions = int(section["max_position_embeddings"])
    seq_length = int(settings.get("seq_length") or min(positions, 4096))
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    section |= {
        "model_family": "gpt",
        "precision": PRECISIONS.get(dtype, 32),
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "encoder_seq_length": seq_length,
        "make_vocab_size_divisible_by": 1,  # the checkpoint's rows as they are
        "share_embeddings_and_output_weights": tied,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "apply_query_key_layer_scaling": False,
        "transformer_engine": False,
        "tokenizer": tokenizer_section(directory),
        "data": {"seq_length": seq_length},
        "hf_architecture": (config.get("architectures") or [None])[0],
    }
    make = gpt2_tensors if gpt2 else rotary_tensors
    return section, make(source, section, tied)
