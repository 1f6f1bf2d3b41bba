"""A GPT's full tensors (megatron-core names) as a Hugging Face transformers checkpoint.

The input is what `load_plain_tensors` reads from a training checkpoint: one full tensor per
key, whatever TP/PP wrote it, with the layers stacked on a leading axis. The output is the
config.json and the state dict of a standard architecture (families/gpt_architectures.py),
loadable by transformers with no custom code.
"""

from __future__ import annotations

from typing import Any

import torch

from launcher_scripts.families.base import Architecture
from launcher_scripts.families.gpt_architectures import (
    GPT2,
    HF_GELU,
    MISTRAL,
    MIXTRAL,
    QWEN2,
    QWEN2_MOE,
    QWEN3_MOE,
    STABLELM,
    hf_architecture,
)
from launcher_scripts.families.gpt_hf_config import (
    EXPERT_NAMES,
    LLAMA3_ORIGINAL_POSITIONS,
    LLAMA3_ROPE,
    ExpertNames,
)
from launcher_scripts.formats.portable import REWARD_HEAD
from launcher_scripts.jobs.models.base import HfModel
from launcher_scripts.jobs.models.hf_common import dtype_name, split_qkv
from launcher_scripts.jobs.models.hf_common import head_dims as _dims

LAYERS = "decoder.layers."
NORM_WEIGHTS = ("layer_norm_weight", "final_layernorm.weight")


def _standard_norms(model: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LayerNorm1p keeps gamma - 1; a standard LayerNorm wants gamma itself."""
    if model.get("normalization") != "layernorm1p":
        return tensors
    return {
        key: value + 1 if key.endswith(NORM_WEIGHTS) else value for key, value in tensors.items()
    }


def to_hf(model: Any, tensors: dict[str, torch.Tensor]) -> HfModel:
    """The checkpoint for the recipe's `model` section and its tensors (a reward model's: the
    architecture's sequence classifier)."""
    architecture = hf_architecture(model)
    tensors = _standard_norms(model, tensors)
    if architecture == GPT2:
        config, state = _gpt2(model, tensors)
    else:
        config, state = _rotary(model, tensors, architecture)
    if REWARD_HEAD in tensors:
        config, state = _sequence_classifier(config, state, tensors[REWARD_HEAD])
    return HfModel(config, state)


def _sequence_classifier(
    config: dict[str, Any], state: dict[str, torch.Tensor], head: torch.Tensor
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A language model's checkpoint as its architecture's `*ForSequenceClassification` with
    one label: the reward head is its `score` layer, read at each row's last token."""
    name = config["architectures"][0]
    classifier = name.replace("LMHeadModel", "ForSequenceClassification").replace(
        "ForCausalLM", "ForSequenceClassification"
    )
    state = {key: value for key, value in state.items() if key != "lm_head.weight"}
    state["score.weight"] = head
    labels = {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
    return config | {"architectures": [classifier], **labels}, state


def _common_config(tensors: dict[str, torch.Tensor], architecture: Architecture) -> dict:
    embeddings = tensors["embedding.word_embeddings.weight"]
    return {
        "architectures": [architecture.name],
        "model_type": architecture.model_type,
        "vocab_size": int(embeddings.shape[0]),
        "tie_word_embeddings": "output_layer.weight" not in tensors,
        "torch_dtype": dtype_name(embeddings),
    }


def _output_layer(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return tensors.get("output_layer.weight", tensors["embedding.word_embeddings.weight"])


def _gpt2(model: Any, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    heads, groups, head_dim = _dims(model)
    layers = int(model.num_layers)
    hidden = int(model.hidden_size)
    config = _common_config(tensors, GPT2) | {
        "n_positions": int(model.max_position_embeddings),
        "n_embd": hidden,
        "n_layer": layers,
        "n_head": heads,
        "n_inner": int(model.ffn_hidden_size),
        # transformers' gelu is the exact (erf) GeLU, gelu_new the tanh approximation
        "activation_function": HF_GELU[str(model.get("activation", "gelu"))],
        "layer_norm_epsilon": float(model.get("layernorm_epsilon", 1e-5)),
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
    }

    def bias(name: str, size: int, layer: int | None = None) -> torch.Tensor:
        key = f"{LAYERS}{name}"
        if key in tensors:
            return tensors[key][layer]
        dtype = tensors["embedding.word_embeddings.weight"].dtype
        return torch.zeros(size, dtype=dtype)  # a bias-free model: GPT-2's biases are zero

    state = {
        "transformer.wte.weight": tensors["embedding.word_embeddings.weight"],
        "transformer.wpe.weight": tensors["embedding.position_embeddings.weight"],
        "transformer.ln_f.weight": tensors["decoder.final_layernorm.weight"],
        "transformer.ln_f.bias": tensors["decoder.final_layernorm.bias"],
    }
    for i in range(layers):
        prefix = f"transformer.h.{i}."
        qkv = tensors[f"{LAYERS}self_attention.linear_qkv.weight"][i]
        q, k, v = split_qkv(qkv, heads, groups, head_dim)
        qkv_bias = bias("self_attention.linear_qkv.bias", qkv.shape[0], i)
        qb, kb, vb = split_qkv(qkv_bias, heads, groups, head_dim)
        # GPT-2's Conv1D keeps weights as [in, out]: the transpose of a Linear's.
        state |= {
            f"{prefix}ln_1.weight": tensors[f"{LAYERS}self_attention.linear_qkv.layer_norm_weight"][
                i
            ],
            f"{prefix}ln_1.bias": tensors[f"{LAYERS}self_attention.linear_qkv.layer_norm_bias"][i],
            f"{prefix}attn.c_attn.weight": torch.cat([q, k, v]).t(),
            f"{prefix}attn.c_attn.bias": torch.cat([qb, kb, vb]),
            f"{prefix}attn.c_proj.weight": tensors[f"{LAYERS}self_attention.linear_proj.weight"][
                i
            ].t(),
            f"{prefix}attn.c_proj.bias": bias("self_attention.linear_proj.bias", hidden, i),
            f"{prefix}ln_2.weight": tensors[f"{LAYERS}mlp.linear_fc1.layer_norm_weight"][i],
            f"{prefix}ln_2.bias": tensors[f"{LAYERS}mlp.linear_fc1.layer_norm_bias"][i],
            f"{prefix}mlp.c_fc.weight": tensors[f"{LAYERS}mlp.linear_fc1.weight"][i].t(),
            f"{prefix}mlp.c_fc.bias": bias("mlp.linear_fc1.bias", int(model.ffn_hidden_size), i),
            f"{prefix}mlp.c_proj.weight": tensors[f"{LAYERS}mlp.linear_fc2.weight"][i].t(),
            f"{prefix}mlp.c_proj.bias": bias("mlp.linear_fc2.bias", hidden, i),
        }
    if not config["tie_word_embeddings"]:
        state["lm_head.weight"] = _output_layer(tensors)
    return config, state


def rope_scaling(model: Any) -> dict[str, Any] | None:
    factor = model.get("rope_scaling_factor")
    if factor is None:
        return None
    return {
        "rope_type": "llama3",
        "factor": float(factor),
        **LLAMA3_ROPE,
        "original_max_position_embeddings": LLAMA3_ORIGINAL_POSITIONS,
    }


def _rotary(
    model: Any, tensors: dict[str, torch.Tensor], architecture: Architecture
) -> tuple[dict, dict[str, torch.Tensor]]:
    rms = architecture != STABLELM
    heads, groups, head_dim = _dims(model)
    layers = int(model.num_layers)
    eps = float(model.get("layernorm_epsilon", 1e-5))
    qkv_bias = f"{LAYERS}self_attention.linear_qkv.bias"
    config = _common_config(tensors, architecture) | {
        "hidden_size": int(model.hidden_size),
        "intermediate_size": int(model.ffn_hidden_size),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "hidden_act": "silu",
        "max_position_embeddings": int(model.max_position_embeddings),
        "rope_theta": float(model.get("rotary_base", 10000)),
        "attention_dropout": 0.0,
    }
    if rms:
        config |= {"head_dim": head_dim, "rms_norm_eps": eps}
        if architecture in (QWEN2, QWEN2_MOE, QWEN3_MOE):
            config |= {"use_sliding_window": False, "sliding_window": None}
        elif architecture in (MISTRAL, MIXTRAL):
            config |= {"sliding_window": None}
        else:
            config |= {"attention_bias": False, "mlp_bias": False}
        if rope_scaling(model) is not None:
            config["rope_scaling"] = rope_scaling(model)
    else:
        config |= {
            "layer_norm_eps": eps,
            "partial_rotary_factor": float(model.get("rotary_percentage", 1.0)),
            "use_qkv_bias": qkv_bias in tensors,
            "qk_layernorm": False,
            "use_parallel_residual": False,
            "hidden_dropout": 0.0,
        }

    def norm(key: str, prefix: str, layer: int | None) -> dict[str, torch.Tensor]:
        pick = (lambda t: t) if layer is None else (lambda t: t[layer])
        out = {f"{prefix}.weight": pick(tensors[f"{key}_weight"])}
        if not rms:
            out[f"{prefix}.bias"] = pick(tensors[f"{key}_bias"])
        return out

    state: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": tensors["embedding.word_embeddings.weight"],
        "lm_head.weight": _output_layer(tensors),
    }
    final = "decoder.final_layernorm"
    state |= {
        "model.norm.weight": tensors[f"{final}.weight"],
        **({} if rms else {"model.norm.bias": tensors[f"{final}.bias"]}),
    }
    ffn = int(model.ffn_hidden_size)
    names = EXPERT_NAMES.get(architecture.model_type)
    if names is not None:
        config |= _experts_config(model, architecture)
    for i in range(layers):
        prefix = f"model.layers.{i}."
        q, k, v = split_qkv(
            tensors[f"{LAYERS}self_attention.linear_qkv.weight"][i], heads, groups, head_dim
        )
        state |= norm(
            f"{LAYERS}self_attention.linear_qkv.layer_norm", f"{prefix}input_layernorm", i
        )
        state |= {
            f"{prefix}self_attn.q_proj.weight": q,
            f"{prefix}self_attn.k_proj.weight": k,
            f"{prefix}self_attn.v_proj.weight": v,
            f"{prefix}self_attn.o_proj.weight": tensors[
                f"{LAYERS}self_attention.linear_proj.weight"
            ][i],
        }
        if qkv_bias in tensors:
            qb, kb, vb = split_qkv(tensors[qkv_bias][i], heads, groups, head_dim)
            state |= {
                f"{prefix}self_attn.q_proj.bias": qb,
                f"{prefix}self_attn.k_proj.bias": kb,
                f"{prefix}self_attn.v_proj.bias": vb,
            }
        if architecture == QWEN3_MOE:
            state |= {
                f"{prefix}self_attn.{p}_norm.weight": tensors[
                    f"{LAYERS}self_attention.{p}_layernorm.weight"
                ][i]
                for p in "qk"
            }
        if names is not None:
            state[f"{prefix}post_attention_layernorm.weight"] = tensors[
                f"{LAYERS}pre_mlp_layernorm.weight"
            ][i]
            state |= _experts_state(model, tensors, names, prefix, i)
            continue
        fc1 = tensors[f"{LAYERS}mlp.linear_fc1.weight"][i]  # [gate; up], as megatron chunks it
        state |= norm(f"{LAYERS}mlp.linear_fc1.layer_norm", f"{prefix}post_attention_layernorm", i)
        state |= {
            f"{prefix}mlp.gate_proj.weight": fc1[:ffn],
            f"{prefix}mlp.up_proj.weight": fc1[ffn:],
            f"{prefix}mlp.down_proj.weight": tensors[f"{LAYERS}mlp.linear_fc2.weight"][i],
        }
    if config["tie_word_embeddings"]:
        del state["lm_head.weight"]
    return config, state


def _experts_config(model: Any, architecture: Architecture) -> dict[str, Any]:
    count, top_k = int(model.num_moe_experts), int(model.get("moe_router_topk", 2))
    width = int(model.get("moe_ffn_hidden_size") or model.ffn_hidden_size)
    aux = float(model.get("moe_aux_loss_coeff") or 0.0)
    common = {"num_experts_per_tok": top_k, "router_aux_loss_coef": aux}
    common["output_router_logits"] = False
    if architecture == MIXTRAL:
        return common | {"num_local_experts": count, "intermediate_size": width}
    qwen = common | {
        "num_experts": count,
        "moe_intermediate_size": width,
        "norm_topk_prob": not bool(model.get("moe_router_pre_softmax", False)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    if architecture == QWEN3_MOE:
        return qwen | {"attention_bias": False}
    return qwen | {
        "shared_expert_intermediate_size": int(model.moe_shared_expert_intermediate_size),
        "qkv_bias": bool(model.get("qkv_bias", False)),
    }


def _experts_state(
    model: Any, tensors: dict[str, torch.Tensor], names: ExpertNames, prefix: str, i: int
) -> dict[str, torch.Tensor]:
    """Layer i's experts as the hub's checkpoints keep them: one tensor per expert and
    projection (transformers loads them into its fused experts itself)."""
    width = int(model.get("moe_ffn_hidden_size") or model.ffn_hidden_size)
    fc1 = tensors[f"{LAYERS}mlp.experts.experts.linear_fc1.weight"][i]  # [experts, 2w, h]
    fc2 = tensors[f"{LAYERS}mlp.experts.experts.linear_fc2.weight"][i]
    state = {f"{prefix}{names.router}": tensors[f"{LAYERS}mlp.router.weight"][i]}
    for j in range(fc1.shape[0]):
        expert = f"{prefix}{names.expert.format(j)}"
        state |= {
            f"{expert}{names.gate}.weight": fc1[j][:width],
            f"{expert}{names.up}.weight": fc1[j][width:],
            f"{expert}{names.down}.weight": fc2[j],
        }
    if names.shared is not None and names.shared_gate is not None:
        shared = int(model.moe_shared_expert_intermediate_size)
        fc1 = tensors[f"{LAYERS}mlp.shared_experts.linear_fc1.weight"][i]
        state |= {
            f"{prefix}{names.shared}gate_proj.weight": fc1[:shared],
            f"{prefix}{names.shared}up_proj.weight": fc1[shared:],
            f"{prefix}{names.shared}down_proj.weight": tensors[
                f"{LAYERS}mlp.shared_experts.linear_fc2.weight"
            ][i],
            f"{prefix}{names.shared_gate}": tensors[f"{LAYERS}mlp.shared_experts.gate_weight"][i],
        }
    return state
