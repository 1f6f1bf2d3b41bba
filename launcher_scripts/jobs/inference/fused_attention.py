"""megatron-core's local core attention computed by torch's fused scaled_dot_product_attention,
for inference.

megatron-core's local DotProductAttention (the layer spec without Transformer Engine, as on a
CPU) copies a grouped-query model's keys and values once per query head (`repeat_interleave`)
and runs the scores, the masked softmax and the weighted sum as separate kernels: in decoding,
where the keys are the whole KV cache, the copies grow with the positions (a Llama-style model
took 1.9x the time per token at position 1000 as at 64). The fused kernel reads grouped keys
as they are. Same inputs and result ([sq, b, heads x head dim]); masked positions are pushed
down by megatron-core's -10000 rather than -inf, so a query with every key masked (a padding
column's, whose output nothing reads) stays finite as there, though not the same.

Installed only in place of exactly that module and only where it computes nothing else
(no query-key layer scaling, no learned softmax offset, no dropout at inference): Transformer
Engine's attention, and our T5's biased attention, stay as they are.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

MASKED = -10000.0  # megatron-core's attention_mask_func fill
GQA_IN_KERNEL = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


class MaskBias:
    """The additive bias of an attention mask, made once per mask for all a model's layers
    (each layer is handed the same mask tensor in one forward); None for a mask that hides
    nothing, such as a decoding step's where every sequence starts at position 0, which lets
    the kernel run unmasked."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def of(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        if mask is not self.mask or (self.bias is not None and self.bias.dtype != dtype):
            self.mask, self.bias = mask, None
            if bool(mask.any()):
                bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
                self.bias = bias.masked_fill_(mask, MASKED)
        return self.bias


class FusedLocalAttention(torch.nn.Module):
    def __init__(self, local: Any, biases: MaskBias | None = None) -> None:
        super().__init__()
        self.biases = biases or MaskBias()
        self.scale = float(local.softmax_scale)
        self.heads = int(local.num_attention_heads_per_partition)
        self.groups = int(local.num_query_groups_per_partition)
        self.hidden = int(local.hidden_size_per_partition)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("the fused local attention takes no bias and no packed sequences")
        length, batch = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        grouped = self.groups != self.heads
        rows = grouped and length == 1 and k.shape[2] > 1 and _per_row(attention_mask)
        if rows:
            # A decoding step: a group's query heads are rows of one query over its keys.
            q = q.reshape(batch, self.groups, self.heads // self.groups, q.shape[-1])
            grouped = False
        if grouped and not GQA_IN_KERNEL:
            k = k.repeat_interleave(self.heads // self.groups, dim=1)
            v = v.repeat_interleave(self.heads // self.groups, dim=1)
        options: dict[str, Any] = {"scale": self.scale}
        if grouped and GQA_IN_KERNEL:
            options["enable_gqa"] = True
        if attention_mask is not None:
            bias = self.biases.of(attention_mask, q.dtype)
            if bias is not None:
                options["attn_mask"] = bias
        elif length == k.shape[2] and "causal" in str(attn_mask_type):
            options["is_causal"] = True
        context = F.scaled_dot_product_attention(q, k, v, **options)
        if rows:
            context = context.reshape(batch, self.heads, 1, context.shape[-1])
        return context.permute(2, 0, 1, 3).reshape(length, batch, self.hidden)


def _per_row(mask: torch.Tensor | None) -> bool:
    """Whether a mask is the same for every query head and query of a row."""
    return mask is None or (mask.shape[1] == 1 and mask.shape[2] == 1)


def fuse_local_attention(chunks: list[Any]) -> int:
    """Put the fused attention in place of each plain local core attention; how many."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    replaced, biases = 0, MaskBias()
    for chunk in chunks:
        for module in list(chunk.modules()):
            local = getattr(module, "core_attention", None)
            if type(local) is not DotProductAttention or not _plain(local):
                continue
            module.core_attention = FusedLocalAttention(local, biases)
            replaced += 1
    return replaced


def _plain(local: Any) -> bool:
    config = local.config
    return (
        getattr(local, "softmax_offset", None) is None
        and not getattr(config, "apply_query_key_layer_scaling", False)
        and float(getattr(local.attention_dropout, "p", 0.0)) == 0.0
    )
