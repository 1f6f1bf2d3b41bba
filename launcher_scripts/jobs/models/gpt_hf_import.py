"""A Hugging Face decoder-only checkpoint as a GPT: our model section (families/gpt_hf_config),
the tokenizer that goes with it, and our full tensors (megatron-core's names, layers stacked)
made one layer at a time from the checkpoint's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from launcher_scripts.families.gpt import GPT
from launcher_scripts.families.gpt_architectures import GPT2
from launcher_scripts.families.gpt_hf_config import (
    EXPERT_NAMES,
    PRECISIONS,
    ExpertNames,
    model_section,
    tokenizer_files,
)
from launcher_scripts.formats.safetensors_stream import Reader, StreamedTensor, TensorSource
from launcher_scripts.jobs.models.hf_common import Piece, copied, merge_qkv, stacked

LAYERS = "decoder.layers."


# ----- tensors ----------------------------------------------------------------------------
# Each of ours is made by a function of (read, layer), read giving a checkpoint tensor by name;
# run on meta tensors first, for the shapes the file's header needs.


def prefixed(per_layer: dict[str, Piece]) -> dict[str, Piece]:
    return {f"{LAYERS}{name}": piece for name, piece in per_layer.items()}


def expert_pieces(names: ExpertNames, count: int, layer: str) -> dict[str, Piece]:
    """A MoE layer's tensors (megatron-core's: the experts stacked on a leading axis, each
    fc1 [gate; up]; the pre-MLP norm under its own key) from a checkpoint's per-expert ones."""

    def read_all(read: Reader, i: int, projection: str) -> list[torch.Tensor]:
        expert = layer.format(i) + names.expert
        return [read(f"{expert.format(j)}{projection}.weight") for j in range(count)]

    def fc1(read: Reader, i: int) -> torch.Tensor:
        gates, ups = read_all(read, i, names.gate), read_all(read, i, names.up)
        return torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups, strict=True)])

    pieces: dict[str, Piece] = {
        "pre_mlp_layernorm.weight": lambda read, i: read(
            layer.format(i) + "post_attention_layernorm.weight"
        ),
        "mlp.router.weight": lambda read, i: read(layer.format(i) + names.router),
        "mlp.experts.experts.linear_fc1.weight": fc1,
        "mlp.experts.experts.linear_fc2.weight": lambda read, i: torch.stack(
            read_all(read, i, names.down)
        ),
    }
    if names.shared is not None:
        shared, gate = names.shared, names.shared_gate
        assert gate is not None

        def shared_fc1(read: Reader, i: int) -> torch.Tensor:
            parts = (read(f"{layer.format(i)}{shared}{p}_proj.weight") for p in ("gate", "up"))
            return torch.cat(list(parts))

        pieces |= {
            "mlp.shared_experts.linear_fc1.weight": shared_fc1,
            "mlp.shared_experts.linear_fc2.weight": lambda read, i: read(
                f"{layer.format(i)}{shared}down_proj.weight"
            ),
            "mlp.shared_experts.gate_weight": lambda read, i: read(layer.format(i) + gate),
        }
    return pieces


def rotary_tensors(
    source: TensorSource, section: dict[str, Any], tied: bool, model_type: str = ""
) -> list[StreamedTensor]:
    heads, groups = section["num_attention_heads"], section["num_query_groups"]
    channels = section["kv_channels"]
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
        return torch.cat([gate, up])

    per_layer: dict[str, Piece] = {
        "self_attention.linear_qkv.layer_norm_weight": fetch("input_layernorm.weight"),
        "self_attention.linear_qkv.weight": fused("weight"),
        "self_attention.linear_proj.weight": fetch("self_attn.o_proj.weight"),
    }
    names = EXPERT_NAMES.get(model_type)
    if names is None:
        per_layer |= {
            "mlp.linear_fc1.layer_norm_weight": fetch("post_attention_layernorm.weight"),
            "mlp.linear_fc1.weight": fc1,
            "mlp.linear_fc2.weight": fetch("mlp.down_proj.weight"),
        }
    else:
        per_layer |= expert_pieces(names, section["num_moe_experts"], layer)
    if bias:
        per_layer["self_attention.linear_qkv.layer_norm_bias"] = fetch("input_layernorm.bias")
        per_layer["mlp.linear_fc1.layer_norm_bias"] = fetch("post_attention_layernorm.bias")
    if section["qkv_bias"]:
        per_layer["self_attention.linear_qkv.bias"] = fused("bias")
    if section.get("qk_layernorm"):  # Qwen3's norms over each head's queries and keys
        per_layer["self_attention.q_layernorm.weight"] = fetch("self_attn.q_norm.weight")
        per_layer["self_attention.k_layernorm.weight"] = fetch("self_attn.k_norm.weight")
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
    settings = directory / "tokenizer_config.json"
    section = {"library": None, "type": None, "model": None, "vocab_file": None}
    section |= {"merge_file": None, "delimiter": None, "eod_token": eos}
    section["hf_config"] = str(settings) if settings.is_file() else None
    path, merges = tokenizer_files(directory)
    if merges is not None:
        return section | {
            "library": "megatron",
            "type": "GPT2BPETokenizer",
            "vocab_file": str(path),
            "merge_file": str(merges),
        }
    library = "huggingface" if path.suffix == ".json" else "sentencepiece"
    return section | {"library": library, "model": str(path)}


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
    """The GPT family's import (ModelFamily.hf_importer): (our model section, our tensors)."""
    section = model_section(config)
    # Whether the output layer is the embedding table: the checkpoint's own lm_head, or none.
    tied = "lm_head.weight" not in source
    if not tied and bool(config.get("tie_word_embeddings", False)):
        tied = True  # a copy of the table written beside it; the config says they are one
    positions = int(section["max_position_embeddings"])
    seq_length = int(settings.get("seq_length") or min(positions, 4096))
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    section |= {
        "model_family": GPT.name,
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
    if config["model_type"] == GPT2.model_type:
        return section, gpt2_tensors(source, section, tied)
    return section, rotary_tensors(source, section, tied, config["model_type"])
