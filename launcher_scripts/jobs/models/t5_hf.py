"""A T5's full tensors (megatron-core names, layers stacked) as a Hugging Face checkpoint of
T5ForConditionalGeneration or MT5ForConditionalGeneration (T5 v1.1's layout, which the family's
spec checks first).

Two differences in how the two compute the same thing: transformers' T5 attention does not
scale q.k by 1/sqrt(head size) (Mesh TensorFlow folded it into the initialisation), so the
query weights carry megatron-core's scale; and megatron-core interleaves the fused QKV (and the
cross-attention's KV) weights per head, where transformers keeps separate matrices.
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import OmegaConf

from launcher_scripts.families.t5 import HF_FEED_FORWARD, hf_architecture
from launcher_scripts.jobs.models.base import HfModel
from launcher_scripts.jobs.models.hf_common import dtype_name, head_dims, split_kv, split_qkv


def _attention(
    tensors: dict[str, torch.Tensor], stack: str, i: int, block: Any
) -> dict[str, torch.Tensor]:
    heads, groups, head_dim = head_dims(block)
    scale = head_dim**-0.5
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


def _cross_attention(
    tensors: dict[str, torch.Tensor], i: int, block: Any
) -> dict[str, torch.Tensor]:
    heads, _, head_dim = head_dims(block)
    layers = "decoder.layers."
    k, v = split_kv(tensors[f"{layers}cross_attention.linear_kv.weight"][i], heads, head_dim)
    return {
        "layer_norm.weight": tensors[f"{layers}pre_cross_attn_layernorm.weight"][i],
        "EncDecAttention.q.weight": tensors[f"{layers}cross_attention.linear_q.weight"][i]
        * head_dim**-0.5,
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
        # A separate output layer, and no d_model**-0.5 on the decoder's output (T5 v1.1).
        "tie_word_embeddings": False,
        "pad_token_id": vocab.pad,
        "eos_token_id": vocab.eos,
        "decoder_start_token_id": vocab.bos,
        "torch_dtype": dtype_name(words),
    }
    # transformers takes the stacks' embeddings from `shared` (one table for both).
    state = {
        "shared.weight": words,
        "lm_head.weight": tensors["lm_head.output_layer.weight"],
        "encoder.final_layer_norm.weight": tensors["encoder.final_layernorm.weight"],
        "decoder.final_layer_norm.weight": tensors["decoder.final_layernorm.weight"],
    }
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
