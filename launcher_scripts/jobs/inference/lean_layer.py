"""megatron-core's TransformerLayer and MLP with inference-only forwards.

A layer's forward in megatron-core wraps its four parts (the input norm, self-attention, the
pre-MLP norm, the MLP) in what training needs: recompute checkpoints, activation-offload
contexts, NVTX ranges, bias-dropout-add functions built per call, a cross-attention slot that
is an identity op in a decoder-only model, and a view-less copy of the output for autograd's
checkpointing. A decoding step of a small model spent about a seventh of its time there. At
inference a pre-norm layer is the four parts and two residual sums, here called as they are:
the same modules, the same operations in the same order (the bias added to the output, then
the residual added to that, as megatron-core's unfused bias-dropout-add does with dropout off).

Installed per layer, only on a model opened for inference, and only where the forward computes
exactly that: a plain TransformerLayer (not MoE), no cross-attention, megatron-core's own
bias-dropout-add in both slots (BERT's post-norm slots stay), no recompute, no offloading, no
fused TP inference kernels. A call in training mode, or with an argument this forward does not
know, goes to megatron-core's forward.

The MLP likewise: megatron-core's builds its gated-unit closure and reads the activation's
fusion and clamping options at every call, and adds a zero offset to the linear half. At
inference, where nothing is fused or clamped: the first linear layer, its bias, the activation
(of the gate times the linear half), the second linear layer. Every plain MLP takes it,
T5's decoder's too.
"""

from __future__ import annotations

import types
from typing import Any

import torch

# What megatron-core's TransformerBlock passes to a layer, all forwarded to self-attention...
_ATTENTION_ARGUMENTS = frozenset(
    {
        "attention_mask",
        "rotary_pos_emb",
        "rotary_pos_cos",
        "rotary_pos_sin",
        "rotary_pos_cos_sin",
        "attention_bias",
        "inference_context",
        "packed_seq_params",
        "sequence_len_offset",
    }
)
# ...and what it may pass that a layer without cross-attention or experts does not read.
_UNREAD = frozenset({"context", "context_mask", "padding_mask", "dynamic_inference_decode_only"})


def _with_bias_and_residual(output_with_bias: tuple[Any, Any], residual: torch.Tensor) -> Any:
    output, bias = output_with_bias
    if bias is not None:
        output = output + bias
    return residual + output


def _layer_forward(self: Any, hidden_states: torch.Tensor, **arguments: Any) -> tuple[Any, Any]:
    if self.training or not arguments.keys() <= _ATTENTION_ARGUMENTS | _UNREAD:
        return type(self).forward(self, hidden_states, **arguments)
    attended = self.self_attention(
        self.input_layernorm(hidden_states),
        **{name: value for name, value in arguments.items() if name in _ATTENTION_ARGUMENTS},
    )
    hidden = _with_bias_and_residual(attended, hidden_states)
    output = _with_bias_and_residual(self.mlp(self.pre_mlp_layernorm(hidden)), hidden)
    return output, arguments.get("context")


def _mlp_forward(
    self: Any, hidden_states: torch.Tensor, per_token_scale: Any = None, **options: Any
) -> tuple[Any, Any]:
    # An expert's MLP (called with its tokens' routing weights) keeps megatron-core's forward.
    if self.training or per_token_scale is not None:
        return type(self).forward(self, hidden_states, per_token_scale, **options)
    intermediate, bias = self.linear_fc1(hidden_states)
    if bias is not None:
        intermediate = intermediate + bias
    activation = self.config.activation_func
    if self.config.gated_linear_unit:
        gate, linear = torch.chunk(intermediate, 2, dim=-1)
        intermediate = activation(gate) * linear
    else:
        intermediate = activation(intermediate)
    return self.linear_fc2(intermediate)


def _plain_mlp(module: Any) -> bool:
    from megatron.core.transformer.mlp import MLP

    if type(module) is not MLP:
        return False
    config = module.config
    return (
        not config.use_te_activation_func
        and not config.bias_activation_fusion
        and getattr(config, "activation_func_clamp_value", None) is None
        and getattr(config, "glu_linear_offset", 0.0) == 0.0
    )


def _plain(layer: Any) -> bool:
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.identity_op import IdentityOp

    config = layer.config
    return (
        isinstance(layer.cross_attention, IdentityOp)
        and layer.self_attn_bda is get_bias_dropout_add
        and layer.mlp_bda is get_bias_dropout_add
        and not getattr(layer, "is_moe_layer", False)
        and not getattr(config, "inference_fuse_tp_communication", False)
        and not any(
            getattr(layer, flag, False)
            for flag in (
                "recompute_input_layernorm",
                "recompute_pre_mlp_layernorm",
                "recompute_mlp",
                "offload_attn_norm",
                "offload_mlp_norm",
            )
        )
    )


def lean_layers(chunks: list[Any]) -> int:
    """Give each plain transformer layer and MLP of the chunks the inference forward; how
    many layers."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    replaced = 0
    for chunk in chunks:
        for module in chunk.modules():
            if type(module) is TransformerLayer and _plain(module):
                module.forward = types.MethodType(_layer_forward, module)
                replaced += 1
            elif _plain_mlp(module):
                module.forward = types.MethodType(_mlp_forward, module)
    return replaced
