"""Rotary embeddings applied to a key once, when it enters the KV cache.

megatron-core's static inference context keeps keys un-rotated and rotates the whole cache
again at every step (`Attention.forward` applies the rotary embedding to every cached key
after `_adjust_key_value_for_inference` returns them), so each generated token costs
rotating every position before it, in every layer: a Llama-style model's time per token grew
with the position and a fifth of a short step went to it. Its fix, rotating at append
(`flash_decode`), comes with flash-attention's decoding kernel, on a GPU only.

Here the same function megatron-core calls (`apply_rotary_pos_emb`, with the layer's config)
rotates the new queries and keys at their cache positions before the keys are stored, and the
attention then sees no rotary embedding to apply: the same values. A move of the cache's
contents (kv_cache.py `_move`) rotates the moved keys on by the shift, rotations of a position
composing by adding angles, as the distance between positions is what attention depends on.

Installed on a model opened for inference, on self-attention layers with plain rotary
embeddings (not YaRN's scaled ones, not multi-latent attention, not flash decoding).
"""

from __future__ import annotations

import types
from typing import Any

import torch


def rotate_keys_at_append(chunks: list[Any]) -> int:
    """Make each rotary self-attention layer of the chunks rotate at append; how many."""
    from megatron.core.transformer.attention import SelfAttention

    installed = 0
    for chunk in chunks:
        if getattr(chunk, "position_embedding_type", None) != "rope":
            continue
        for module in chunk.modules():
            config = getattr(module, "config", None)
            if (
                not isinstance(module, SelfAttention)
                or config.multi_latent_attention
                or config.flash_decode
            ):
                continue
            adjust = module._adjust_key_value_for_inference
            module._adjust_key_value_for_inference = types.MethodType(_rotating(adjust), module)
            module.rotary_freqs = None  # the context's embedding, kept for moves
            installed += 1
    return installed


def _rotating(adjust: Any) -> Any:
    def rotate_then_adjust(
        self: Any,
        context: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        rotary_pos_emb: Any,
        *rest: Any,
        **options: Any,
    ) -> Any:
        if context is None or rotary_pos_emb is None or not context.is_static_batching():
            return adjust(context, query, key, value, rotary_pos_emb, *rest, **options)
        query_freqs, key_freqs = rotary_pos_emb
        start = context.sequence_len_offset
        end = start + key.shape[0]
        if query_freqs is key_freqs and _plain(self.config):
            query, key = _rotate_both(self, query, key, key_freqs, start, end)
        else:
            query = _rotate(self, query, query_freqs[start:end])
            key = _rotate(self, key, key_freqs[start:end])
        self.rotary_freqs = key_freqs
        return adjust(context, query, key, value, None, *rest, **options)

    return rotate_then_adjust


def _plain(config: Any) -> bool:
    return not config.rotary_interleaved and not config.apply_rope_fusion


def _rotate_both(
    module: Any, query: torch.Tensor, key: torch.Tensor, freqs: torch.Tensor, start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core's unfused rotation (`_apply_rotary_pos_emb_bshd`: t cos + rotated half
    of t sin, the same operations) of the queries and keys together, with the cosines and
    sines of the context's embedding computed once per layer rather than at every step: a
    decoding step of a small model spent a tenth of its time in rotations."""
    if getattr(module, "rotary_cos_sin", (None,))[0] is not freqs:
        dtype = query.dtype
        module.rotary_cos_sin = (freqs, freqs.cos().to(dtype), freqs.sin().to(dtype))
    _, cos, sin = module.rotary_cos_sin
    cos, sin = cos[start:end], sin[start:end]
    both = torch.cat((query, key), dim=2)
    width = cos.shape[-1]
    turning = both[..., :width]
    first, second = turning.chunk(2, dim=-1)
    turned = turning * cos + torch.cat((-second, first), dim=-1) * sin
    if width < both.shape[-1]:  # a partial rotary embedding
        turned = torch.cat((turned, both[..., width:]), dim=-1)
    return turned[:, :, : query.shape[2]], turned[:, :, query.shape[2] :]


def _rotate(module: Any, tensor: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    groups = getattr(module, "pg_collection", None)
    cp_group = getattr(groups, "cp", None)
    return apply_rotary_pos_emb(tensor, freqs, config=module.config, cp_group=cp_group)


def rotated_layers(chunks: list[Any]) -> dict[int, Any]:
    """The layers that store rotated keys, by layer number (the cache's key)."""
    return {
        module.layer_number: module
        for chunk in chunks
        for module in chunk.modules()
        if hasattr(module, "rotary_freqs")
    }


def rotate_moved(module: Any, keys: torch.Tensor, shift: int) -> None:
    """Keys rotated at their old positions, now `shift` positions on ([positions, slots,
    groups, head dim], in place): rotate them by the shift's angle."""
    freqs = module.rotary_freqs
    if freqs is None or shift == 0 or keys.shape[0] == 0:
        return  # nothing was stored rotated yet
    step = freqs[abs(shift)] if shift > 0 else -freqs[abs(shift)]
    by = step.expand(keys.shape[0], *step.shape).contiguous()
    keys.copy_(_rotate(module, keys, by))
