"""Which Hugging Face transformers architecture holds a given GPT recipe exactly.

Torch-free: the conversion stage's preflight asks this before anything is submitted, so a model
that no standard architecture can represent is refused with the key that makes it so.

    learned positions, GeLU, LayerNorm(1p)         -> GPT2LMHeadModel
    RoPE, SwiGLU, LayerNorm(1p), no linear biases  -> StableLmForCausalLM
    RoPE, SwiGLU, RMSNorm, no linear biases        -> LlamaForCausalLM
"""

from __future__ import annotations

from typing import Any

from launcher_scripts.errors import ConfigError
from launcher_scripts.families.base import Architecture, head_size_problem

GPT2 = Architecture("GPT2LMHeadModel", "gpt2")
STABLELM = Architecture("StableLmForCausalLM", "stablelm")
LLAMA = Architecture("LlamaForCausalLM", "llama")


def hf_architecture(model: Any, key_prefix: str = "model") -> Architecture:
    """The architecture for the recipe's `model` section, or ConfigError naming the key."""
    positions = model.get("position_embedding_type", "learned_absolute")
    activation = model.get("activation", "gelu")
    normalization = model.get("normalization", "layernorm")
    bias = bool(model.get("bias", True))
    heads = int(model.num_attention_heads)
    groups = int(model.get("num_query_groups") or heads)

    def refuse(name: str, problem: str) -> ConfigError:
        return ConfigError(
            f"{key_prefix}.{name}",
            f"{problem}: no standard transformers architecture holds this model",
            "Export the GPT-2 style model (learned_absolute, gelu, layernorm) or the improved "
            "one (rope, swiglu, bias=false), or set the Hugging Face export off",
        )

    head_size = head_size_problem(model)
    if head_size:
        raise refuse("kv_channels", head_size)
    if positions == "learned_absolute":
        if activation != "gelu":
            raise refuse("activation", f"{activation!r} with learned position embeddings")
        if normalization == "rmsnorm":
            raise refuse("normalization", "rmsnorm with learned position embeddings")
        if groups != heads:
            raise refuse("num_query_groups", "grouped-query attention in a GPT-2 style model")
        return GPT2
    if positions != "rope":
        raise refuse("position_embedding_type", f"{positions!r}")
    if activation not in ("swiglu", "fast-swiglu"):
        raise refuse("activation", f"{activation!r} with rotary embeddings")
    if bias:
        raise refuse("bias", "linear biases with rotary embeddings and SwiGLU")
    if float(model.get("rotary_percentage", 1.0)) != 1.0 and normalization == "rmsnorm":
        raise refuse("rotary_percentage", "partial rotary embeddings with RMSNorm")
    return LLAMA if normalization == "rmsnorm" else STABLELM
