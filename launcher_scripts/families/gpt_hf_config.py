"""A Hugging Face decoder-only model's config.json as our GPT model section, checked field by
field: torch-free, so the conversion stage's preflight refuses what cannot be imported (and a
layout the model cannot take) before anything is submitted, and the import job makes the same
section (jobs/models/gpt_hf_import.py).

    LlamaForCausalLM     RMSNorm, SwiGLU, RoPE (rope_theta, Llama 3's rope scaling), GQA
    MistralForCausalLM   Llama's layout (a sliding window is refused: full attention here)
    Qwen2ForCausalLM     Llama's layout with biases on Q, K and V
    MixtralForCausalLM   Llama's layout with experts in every layer (the top-k renormalised)
    Qwen2MoeForCausalLM  Qwen2's with experts in every layer and a gated shared expert
    Qwen3MoeForCausalLM  Llama's layout with experts in every layer and norms over each
                         head's queries and keys
    StableLmForCausalLM  LayerNorm, SwiGLU, partial RoPE, optional Q/K/V biases
    GPT2LMHeadModel      LayerNorm, GeLU (exact or tanh), learned positions, biases everywhere

A setting that changes what the model computes and that megatron-core's GPT cannot compute the
same way is refused in one line naming the config.json field; nothing is approximated. So is a
checkpoint whose tensors or tokenizer disagree with its config.json (check_checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher_scripts.errors import HfImportError
from launcher_scripts.families.gpt_architectures import (
    GPT2,
    LLAMA,
    MISTRAL,
    MIXTRAL,
    QWEN2,
    QWEN2_MOE,
    QWEN3_MOE,
    STABLELM,
)
from launcher_scripts.families.hf_checkpoint import (
    Dimension,
    check_dimensions,
    check_layer_count,
    check_output_layer,
    check_tokenizer,
    tokenizer_size,
)
from launcher_scripts.formats.safetensors_stream import TensorSource

ROTARY_TYPES = (
    LLAMA.model_type,
    MISTRAL.model_type,
    QWEN2.model_type,
    STABLELM.model_type,
    MIXTRAL.model_type,
    QWEN2_MOE.model_type,
    QWEN3_MOE.model_type,
)
MODEL_TYPES = (*ROTARY_TYPES, GPT2.model_type)
# transformers' activation names -> ours (GPT-2's activation_function)
GPT2_ACTIVATIONS = {"gelu_new": "gelu-tanh", "gelu_pytorch_tanh": "gelu-tanh", "gelu": "gelu"}
PRECISIONS = {"float32": 32, "bfloat16": "bf16", "float16": 16}
# Llama 3's rope scaling as megatron-core computes it: only its factor is a setting.
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3_ORIGINAL_POSITIONS = 8192


@dataclass(frozen=True)
class ExpertNames:
    """Where a Hugging Face MoE checkpoint keeps a layer's experts (under model.layers.<i>.),
    as the hub's checkpoints and transformers' save_pretrained write them: one tensor per
    expert and projection."""

    router: str
    expert: str  # with {} for the expert's index
    gate: str  # the SwiGLU's gate, up and down projections, under an expert
    up: str
    down: str
    shared: str | None = None  # the shared expert (gate_proj, up_proj, down_proj under it)
    shared_gate: str | None = None


EXPERT_NAMES = {
    MIXTRAL.model_type: ExpertNames(
        "block_sparse_moe.gate.weight", "block_sparse_moe.experts.{}.", "w1", "w3", "w2"
    ),
    QWEN2_MOE.model_type: ExpertNames(
        "mlp.gate.weight",
        "mlp.experts.{}.",
        "gate_proj",
        "up_proj",
        "down_proj",
        shared="mlp.shared_expert.",
        shared_gate="mlp.shared_expert_gate.weight",
    ),
    QWEN3_MOE.model_type: ExpertNames(
        "mlp.gate.weight", "mlp.experts.{}.", "gate_proj", "up_proj", "down_proj"
    ),
}


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
        if model_type in (QWEN2.model_type, QWEN2_MOE.model_type, QWEN3_MOE.model_type)
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
    if model_type == QWEN2_MOE.model_type:
        qkv_bias = bool(config.get("qkv_bias", True))  # transformers 4's Qwen2-MoE: always
    if model_type == QWEN3_MOE.model_type:
        _require(config, "attention_bias", False, "biases on Qwen3-MoE's projections")
    rope = rope_settings(config)
    return _experts_section(config, model_type) | {
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
        # Qwen3's norms over each head's queries and keys (a key only where it holds)
        **({"qk_layernorm": True} if model_type == QWEN3_MOE.model_type else {}),
    }


def expert_count(config: dict[str, Any]) -> int:
    """The routed experts: `num_local_experts` (Mixtral's name, and what transformers 5 writes
    for the Qwen MoE models too) or `num_experts` (the Qwen models' on the hub)."""
    count = config.get("num_local_experts", config.get("num_experts"))
    if count is None:
        raise HfImportError("config.json has no num_local_experts (or num_experts)")
    return int(count)


def _experts_section(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """A MoE model's experts (none for the others)."""
    if model_type == MIXTRAL.model_type:
        return {
            "num_moe_experts": expert_count(config),
            "moe_router_topk": int(config["num_experts_per_tok"]),
            "moe_ffn_hidden_size": int(config["intermediate_size"]),
            "moe_router_pre_softmax": False,  # the top-k's weights renormalised
            "moe_aux_loss_coeff": float(config.get("router_aux_loss_coef", 0.0)),
        }
    if model_type not in (QWEN2_MOE.model_type, QWEN3_MOE.model_type):
        return {}
    _require(config, "decoder_sparse_step", 1, "this version imports experts in every layer")
    if config.get("mlp_only_layers"):
        raise refuse(
            "mlp_only_layers",
            config["mlp_only_layers"],
            "this version imports experts in every layer",
        )
    shared = {}
    if model_type == QWEN2_MOE.model_type:
        shared = {
            "moe_shared_expert_intermediate_size": int(config["shared_expert_intermediate_size"]),
            "moe_shared_expert_gate": True,
        }
    return shared | {
        "num_moe_experts": expert_count(config),
        "moe_router_topk": int(config["num_experts_per_tok"]),
        "moe_ffn_hidden_size": int(config["moe_intermediate_size"]),
        # norm_topk_prob: the top-k's softmax weights renormalised, which is a softmax over
        # the top-k's logits (megatron-core's default); else the weights as they are.
        "moe_router_pre_softmax": not bool(config.get("norm_topk_prob", False)),
        "moe_aux_loss_coeff": float(config.get("router_aux_loss_coef", 0.0)),
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


def model_section(config: dict[str, Any]) -> dict[str, Any]:
    """Our model section's architecture for a config.json (the import adds the rest), or
    HfImportError naming the field that rules the import out."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise refuse("model_type", model_type, f"the GPT family imports {', '.join(MODEL_TYPES)}")
    try:
        return gpt2_section(config) if model_type == GPT2.model_type else rotary_section(config)
    except KeyError as missing:
        raise HfImportError(f"config.json has no {missing.args[0]}") from None
    except (TypeError, ValueError) as error:
        if isinstance(error, HfImportError):
            raise
        raise HfImportError(f"config.json: a field is not a number ({error})") from None


# ----- the checkpoint against its config.json -----------------------------------------------


def tokenizer_files(directory: Path) -> tuple[Path, Path | None]:
    """The directory's tokenizer: tokenizer.json where there is one, else a SentencePiece
    tokenizer.model, else GPT-2's vocab.json with its merges.txt (the second path)."""
    for name in ("tokenizer.json", "tokenizer.model"):
        if (directory / name).is_file():
            return directory / name, None
    vocab, merges = directory / "vocab.json", directory / "merges.txt"
    if vocab.is_file() and merges.is_file():
        return vocab, merges
    raise HfImportError(
        f"{directory} has no tokenizer.json, tokenizer.model, or vocab.json with merges.txt: "
        "save the model's tokenizer there (tokenizer.save_pretrained)"
    )


def _rotary_dimensions(config: dict[str, Any], section: dict[str, Any]) -> list[Dimension]:
    hidden, ffn = section["hidden_size"], section["ffn_hidden_size"]
    heads, groups = section["num_attention_heads"], section["num_query_groups"]
    channels = section["kv_channels"]
    # (the field, its value): the sizes several fields make together
    queries = ("num_attention_heads x head_dim", heads * channels)
    keys = ("num_key_value_heads x head_dim", groups * channels)
    vocab = int(config["vocab_size"])
    dims = [
        Dimension("vocab_size", vocab, "model.embed_tokens.weight", 0),
        Dimension("vocab_size", vocab, "lm_head.weight", 0),
        Dimension("hidden_size", hidden, "model.embed_tokens.weight", 1),
        Dimension("hidden_size", hidden, "lm_head.weight", 1),
        Dimension("hidden_size", hidden, "model.norm.weight", 0),
    ]
    for i in range(section["num_layers"]):
        layer = f"model.layers.{i}."
        dims += [
            Dimension("hidden_size", hidden, f"{layer}input_layernorm.weight", 0),
            Dimension("hidden_size", hidden, f"{layer}post_attention_layernorm.weight", 0),
            Dimension("hidden_size", hidden, f"{layer}self_attn.q_proj.weight", 1),
            Dimension("hidden_size", hidden, f"{layer}self_attn.o_proj.weight", 0),
            Dimension(*queries, f"{layer}self_attn.o_proj.weight", 1),
            Dimension("hidden_size", hidden, f"{layer}mlp.down_proj.weight", 0),
            Dimension("intermediate_size", ffn, f"{layer}mlp.down_proj.weight", 1),
        ]
        for kind in ("weight", "bias"):
            dims.append(Dimension(*queries, f"{layer}self_attn.q_proj.{kind}", 0))
            dims += [Dimension(*keys, f"{layer}self_attn.{p}_proj.{kind}", 0) for p in "kv"]
        for projection in ("gate", "up"):
            dims += [
                Dimension("intermediate_size", ffn, f"{layer}mlp.{projection}_proj.weight", 0),
                Dimension("hidden_size", hidden, f"{layer}mlp.{projection}_proj.weight", 1),
            ]
        dims += _expert_dimensions(config, section, layer)
    return dims


def _expert_dimensions(config: dict[str, Any], section: dict[str, Any], layer: str) -> list:
    names = EXPERT_NAMES.get(config["model_type"])
    if names is None:
        return []
    hidden, count = section["hidden_size"], section["num_moe_experts"]
    width_field = "intermediate_size" if names.shared is None else "moe_intermediate_size"
    width = (width_field, section["moe_ffn_hidden_size"])
    experts_field = "num_local_experts" if names.shared is None else "num_experts"
    dims = [
        Dimension(experts_field, count, f"{layer}{names.router}", 0),
        Dimension("hidden_size", hidden, f"{layer}{names.router}", 1),
    ]
    for j in range(count):
        expert = f"{layer}{names.expert.format(j)}"
        for projection in (names.gate, names.up):
            dims += [
                Dimension(*width, f"{expert}{projection}.weight", 0),
                Dimension("hidden_size", hidden, f"{expert}{projection}.weight", 1),
            ]
        dims += [
            Dimension("hidden_size", hidden, f"{expert}{names.down}.weight", 0),
            Dimension(*width, f"{expert}{names.down}.weight", 1),
        ]
    if names.shared is not None:
        shared = ("shared_expert_intermediate_size", section["moe_shared_expert_intermediate_size"])
        for projection in ("gate_proj", "up_proj"):
            dims.append(Dimension(*shared, f"{layer}{names.shared}{projection}.weight", 0))
        dims.append(Dimension(*shared, f"{layer}{names.shared}down_proj.weight", 1))
    return dims


def _gpt2_dimensions(
    config: dict[str, Any], section: dict[str, Any], prefix: str
) -> list[Dimension]:
    hidden, positions = section["hidden_size"], section["max_position_embeddings"]
    ffn = ("n_inner" if config.get("n_inner") else "4 x n_embd", section["ffn_hidden_size"])
    vocab = int(config["vocab_size"])
    dims = [
        Dimension("vocab_size", vocab, f"{prefix}wte.weight", 0),
        Dimension("vocab_size", vocab, "lm_head.weight", 0),
        Dimension("n_embd", hidden, f"{prefix}wte.weight", 1),
        Dimension("n_embd", hidden, "lm_head.weight", 1),
        Dimension("n_positions", positions, f"{prefix}wpe.weight", 0),
        Dimension("n_embd", hidden, f"{prefix}wpe.weight", 1),
    ]
    for i in range(section["num_layers"]):
        layer = f"{prefix}h.{i}."  # Conv1D weights are [in, out]
        dims += [
            Dimension("n_embd", hidden, f"{layer}attn.c_attn.weight", 0),
            Dimension("3 x n_embd", 3 * hidden, f"{layer}attn.c_attn.weight", 1),
            Dimension("3 x n_embd", 3 * hidden, f"{layer}attn.c_attn.bias", 0),
            Dimension("n_embd", hidden, f"{layer}attn.c_proj.weight", 0),
            Dimension("n_embd", hidden, f"{layer}attn.c_proj.weight", 1),
            Dimension("n_embd", hidden, f"{layer}mlp.c_fc.weight", 0),
            Dimension(*ffn, f"{layer}mlp.c_fc.weight", 1),
            Dimension(*ffn, f"{layer}mlp.c_fc.bias", 0),
            Dimension(*ffn, f"{layer}mlp.c_proj.weight", 0),
            Dimension("n_embd", hidden, f"{layer}mlp.c_proj.weight", 1),
        ]
    return dims


def check_checkpoint(directory: Path, config: dict[str, Any]) -> None:
    """The checkpoint's tensors and tokenizer agree with its config.json (ModelFamily
    .hf_import_check): HfImportError naming the field, the tensor and both values."""
    section = model_section(config)
    if "vocab_size" not in config:
        raise HfImportError("config.json has no vocab_size")
    source = TensorSource(directory)
    if config["model_type"] == GPT2.model_type:
        prefix = "transformer." if "transformer.wte.weight" in source else ""
        check_dimensions(source, _gpt2_dimensions(config, section, prefix))
        check_layer_count(source, f"{prefix}h.", "n_layer", section["num_layers"])
        embedding = f"{prefix}wte.weight"
    else:
        check_dimensions(source, _rotary_dimensions(config, section))
        check_layer_count(source, "model.layers.", "num_hidden_layers", section["num_layers"])
        embedding = "model.embed_tokens.weight"
    if embedding not in source:
        raise HfImportError(f"{directory}: the checkpoint has no tensor {embedding}")
    check_output_layer(config, source, "lm_head.weight")
    path, merges = tokenizer_files(directory)
    check_tokenizer(path, tokenizer_size(path, merges), source, embedding)
