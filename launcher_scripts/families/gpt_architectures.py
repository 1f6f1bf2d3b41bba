"""Which Hugging Face transformers architecture holds a given GPT recipe exactly.

Torch-free: the conversion stage's preflight asks this before anything is submitted, so a model
that no standard architecture can represent is refused with the key that makes it so.

    learned positions, GeLU (exact or tanh), LayerNorm(1p)      -> GPT2LMHeadModel
    RoPE, SwiGLU, LayerNorm(1p), no linear biases (but QKV's)   -> StableLmForCausalLM
    RoPE, SwiGLU, RMSNorm, no linear biases                     -> LlamaForCausalLM
    RoPE, SwiGLU, RMSNorm, QKV biases only                      -> Qwen2ForCausalLM
    Llama's layer with experts in every layer                    -> MixtralForCausalLM
      ... with a shared expert behind a sigmoid gate             -> Qwen2MoeForCausalLM
      ... with norms over each head's queries and keys           -> Qwen3MoeForCausalLM

A model imported from Hugging Face records its class (`hf_architecture`) and goes back to it
(a Mistral to MistralForCausalLM, not to the Llama class that computes the same).
"""

from __future__ import annotations

from typing import Any

from launcher_scripts.errors import ConfigError
from launcher_scripts.families.base import Architecture, head_size_problem

GPT2 = Architecture("GPT2LMHeadModel", "gpt2")
STABLELM = Architecture("StableLmForCausalLM", "stablelm")
LLAMA = Architecture("LlamaForCausalLM", "llama")
MISTRAL = Architecture("MistralForCausalLM", "mistral")
QWEN2 = Architecture("Qwen2ForCausalLM", "qwen2")
MIXTRAL = Architecture("MixtralForCausalLM", "mixtral")
QWEN2_MOE = Architecture("Qwen2MoeForCausalLM", "qwen2_moe")
QWEN3_MOE = Architecture("Qwen3MoeForCausalLM", "qwen3_moe")
ARCHITECTURES = (GPT2, STABLELM, LLAMA, MISTRAL, QWEN2, MIXTRAL, QWEN2_MOE, QWEN3_MOE)
# Our activation -> transformers' name for the same function (GPT-2's activation_function).
HF_GELU = {"gelu": "gelu", "gelu-tanh": "gelu_new"}
ROTARY_ACTIVATIONS = ("swiglu", "fast-swiglu")


def hf_architecture(model: Any, key_prefix: str = "model") -> Architecture:
    """The architecture for the recipe's `model` section, or ConfigError naming the key."""
    positions = model.get("position_embedding_type", "learned_absolute")
    activation = model.get("activation", "gelu")
    normalization = model.get("normalization", "layernorm")
    bias = bool(model.get("bias", True))
    qkv_bias = bool(model.get("qkv_bias", False)) and not bias
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
    if head_size and (positions == "learned_absolute" or normalization != "rmsnorm"):
        raise refuse("kv_channels", head_size)  # Llama's, Mistral's and Qwen2's have head_dim
    if model.get("rope_scaling_factor") is not None and normalization != "rmsnorm":
        raise refuse("rope_scaling_factor", "Llama 3's rope scaling without RMSNorm")
    if positions == "learned_absolute":
        if activation not in HF_GELU:
            raise refuse("activation", f"{activation!r} with learned position embeddings")
        if normalization == "rmsnorm":
            raise refuse("normalization", "rmsnorm with learned position embeddings")
        if groups != heads:
            raise refuse("num_query_groups", "grouped-query attention in a GPT-2 style model")
        if qkv_bias:
            raise refuse("qkv_bias", "biases on QKV alone in a GPT-2 style model")
        return GPT2
    if positions != "rope":
        raise refuse("position_embedding_type", f"{positions!r}")
    if activation not in ROTARY_ACTIVATIONS:
        raise refuse("activation", f"{activation!r} with rotary embeddings")
    if bias:
        raise refuse("bias", "linear biases with rotary embeddings and SwiGLU")
    if float(model.get("rotary_percentage", 1.0)) != 1.0 and normalization == "rmsnorm":
        raise refuse("rotary_percentage", "partial rotary embeddings with RMSNorm")
    experts = model.get("num_moe_experts")
    if experts and normalization != "rmsnorm":
        raise refuse("normalization", f"{normalization} with experts")
    if model.get("qk_layernorm", False) and not experts:
        raise refuse("qk_layernorm", "query and key norms without experts (Qwen3-MoE's only)")
    if experts:
        return _experts_architecture(model, qkv_bias, refuse)
    if normalization != "rmsnorm":
        return STABLELM
    if qkv_bias:
        return QWEN2
    recorded = model.get("hf_architecture")  # an imported model's own class
    return MISTRAL if recorded == MISTRAL.name else LLAMA


def _experts_architecture(model: Any, qkv_bias: bool, refuse: Any) -> Architecture:
    """Mixtral (routed experts alone, the top-k's weights renormalised), Qwen2-MoE (and a
    shared expert behind a sigmoid gate; the top-k's weights as they are or renormalised) or
    Qwen3-MoE (routed experts alone, norms over each head's queries and keys)."""
    if model.get("moe_layer_freq", 1) != 1:
        raise refuse("moe_layer_freq", "experts in only some layers")
    shared = model.get("moe_shared_expert_intermediate_size")
    if model.get("qk_layernorm", False):
        if shared or qkv_bias:
            raise refuse("qk_layernorm", "query and key norms with a shared expert or QKV biases")
        return QWEN3_MOE
    if not shared:
        if qkv_bias:
            raise refuse("qkv_bias", "QKV biases with experts but no shared expert")
        if model.get("moe_router_pre_softmax", False):
            raise refuse("moe_router_pre_softmax", "Mixtral renormalises its top-k's weights")
        return MIXTRAL
    if not model.get("moe_shared_expert_gate", False):
        raise refuse("moe_shared_expert_gate", "a shared expert without Qwen2-MoE's gate")
    return QWEN2_MOE
