"""A BERT's full tensors (megatron-core names, layers stacked) as a Hugging Face checkpoint.

post_ln is Hugging Face's BERT: LN(word + position + type) on the embeddings, each sub-layer's
sum normalised, no final LayerNorm. pre_ln is megatron-core's layout, which transformers has as
MegatronBert: a LayerNorm before attention and before the MLP, a final one after the stack,
none on the embeddings. The heads (pooler, sentence order, the masked-LM transform and its
output bias) and the output layer (the word embeddings, tied) are the same in both.
"""

from __future__ import annotations

from typing import Any

import torch

from launcher_scripts.families.bert import hf_architecture
from launcher_scripts.jobs.models.base import HfModel
from launcher_scripts.jobs.models.hf_common import dtype_name, head_dims, split_qkv

LAYERS = "encoder.layers."
WEIGHT_AND_BIAS = ("weight", "bias")


def _layer(
    tensors: dict[str, torch.Tensor], model: Any, post_ln: bool, i: int
) -> dict[str, torch.Tensor]:
    heads, groups, head_dim = head_dims(model)
    hidden, ffn = int(model.hidden_size), int(model.ffn_hidden_size)
    sizes = {"self_attention.linear_proj": hidden, "mlp.linear_fc1": ffn, "mlp.linear_fc2": hidden}

    def tensor(name: str, kind: str) -> torch.Tensor:
        key = f"{LAYERS}{name}.{kind}"
        if kind == "bias" and key not in tensors:  # bias=False: Hugging Face's are zeros
            size = 3 * hidden if name.endswith("qkv") else sizes[name]
            return torch.zeros(size, dtype=tensors[f"{LAYERS}{name}.weight"].dtype)
        return tensors[key][i]

    prefix = f"bert.encoder.layer.{i}."
    state: dict[str, torch.Tensor] = {}
    for kind in WEIGHT_AND_BIAS:
        q, k, v = split_qkv(tensor("self_attention.linear_qkv", kind), heads, groups, head_dim)
        state |= {
            f"{prefix}attention.self.query.{kind}": q,
            f"{prefix}attention.self.key.{kind}": k,
            f"{prefix}attention.self.value.{kind}": v,
            f"{prefix}attention.output.dense.{kind}": tensor("self_attention.linear_proj", kind),
            f"{prefix}intermediate.dense.{kind}": tensor("mlp.linear_fc1", kind),
            f"{prefix}output.dense.{kind}": tensor("mlp.linear_fc2", kind),
        }
        if post_ln:
            state |= {
                f"{prefix}attention.output.LayerNorm.{kind}": tensor("self_attn_bda.norm", kind),
                f"{prefix}output.LayerNorm.{kind}": tensor("mlp_bda.norm", kind),
            }
        else:  # megatron-core keeps the pre-norms fused into the linear layers' names
            norms = {
                "attention.ln": "self_attention.linear_qkv.layer_norm_",
                "ln": "mlp.linear_fc1.layer_norm_",
            }
            state |= {
                f"{prefix}{ours}.{kind}": tensors[f"{LAYERS}{theirs}{kind}"][i]
                for ours, theirs in norms.items()
            }
    return state


def to_hf(model: Any, tensors: dict[str, torch.Tensor]) -> HfModel:
    architecture = hf_architecture(model)
    post_ln = str(model.get("transformer_block_type", "pre_ln")) == "post_ln"
    with_head = bool(model.get("bert_binary_head", True))
    words = tensors["embedding.word_embeddings.weight"]
    layers = int(model.num_layers)
    config = {
        "architectures": [architecture.name],
        "model_type": architecture.model_type,
        "vocab_size": int(words.shape[0]),  # with the padding rows: every logit is compared
        "hidden_size": int(model.hidden_size),
        "num_hidden_layers": layers,
        "num_attention_heads": int(model.num_attention_heads),
        "intermediate_size": int(model.ffn_hidden_size),
        "hidden_act": "gelu",  # the exact (erf) GeLU, as megatron-core's layers and LM head
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "max_position_embeddings": int(model.max_position_embeddings),
        "type_vocab_size": 2 if with_head else 1,
        "layer_norm_eps": float(model.get("layernorm_epsilon", 1e-5)),
        "pad_token_id": 0,
        "tie_word_embeddings": True,
        "torch_dtype": dtype_name(words),
    }
    types = tensors.get("embedding.tokentype_embeddings.weight")
    if types is None:  # no sentence-order head, no segments: every token is segment 0
        types = torch.zeros(1, words.shape[1], dtype=words.dtype)
    state = {
        "bert.embeddings.word_embeddings.weight": words,
        "bert.embeddings.position_embeddings.weight": tensors[
            "embedding.position_embeddings.weight"
        ],
        "bert.embeddings.token_type_embeddings.weight": types,
        "cls.predictions.bias": tensors["output_layer.bias"],
    }
    for kind in WEIGHT_AND_BIAS:
        state |= {
            f"cls.predictions.transform.dense.{kind}": tensors[f"lm_head.dense.{kind}"],
            f"cls.predictions.transform.LayerNorm.{kind}": tensors[f"lm_head.layer_norm.{kind}"],
        }
        if post_ln:
            state[f"bert.embeddings.LayerNorm.{kind}"] = tensors[f"embedding.layernorm.{kind}"]
        else:
            state[f"bert.encoder.ln.{kind}"] = tensors[f"encoder.final_layernorm.{kind}"]
        if with_head:
            state[f"bert.pooler.dense.{kind}"] = tensors[f"pooler.dense.{kind}"]
            state[f"cls.seq_relationship.{kind}"] = tensors[f"binary_head.{kind}"]
    for i in range(layers):
        state |= _layer(tensors, model, post_ln, i)
    return HfModel(config, state)
