"""IA3's modules: keys and values (of self-attention, and of a decoder's cross-attention) and
the MLP's intermediate activations scaled by learned vectors, sharded like those features."""

from __future__ import annotations

from typing import Any

import torch

from launcher_scripts.jobs.fine_tuning.peft import (
    Attaching,
    PeftModule,
    PeftSites,
    chosen_layers,
    tp_size,
)
from launcher_scripts.tuning import PeftSettings


class KeyValueScale(PeftModule):
    """Scales the key and value features of linear_qkv's output (megatron-core lays it out as
    [query groups][queries of the group, key, value][head dim] on each TP rank), or of a
    cross-attention's linear_kv (`queries` False: [query groups][key, value][head dim])."""

    def __init__(self, key: str, config: Any, sp: bool, queries: bool = True) -> None:
        super().__init__(key, sp)
        groups = config.num_query_groups or config.num_attention_heads
        self.head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        self.queries_per_group = config.num_attention_heads // groups if queries else 0
        self.local_groups = groups // tp_size()
        self.add("key_value_scale", (self.local_groups * 2 * self.head_dim,), "ones", 0)

    def hook(self, _module: Any, _args: tuple, output: Any) -> Any:
        out, bias = output
        shape = out.shape
        grouped = out.view(*shape[:-1], self.local_groups, self.queries_per_group + 2, -1)
        queries = grouped[..., : self.queries_per_group, :]
        scale = self.key_value_scale.view(self.local_groups, 2, self.head_dim).to(out.dtype)
        keys_values = grouped[..., self.queries_per_group :, :] * scale
        return torch.cat([queries, keys_values], dim=-2).reshape(shape), bias


class FfnScale(PeftModule):
    """Scales the MLP's intermediate activations (linear_fc2's input, split over TP)."""

    def __init__(self, key: str, config: Any, sp: bool) -> None:
        super().__init__(key, sp)
        self.add("ffn_scale", (config.ffn_hidden_size // tp_size(),), "ones", 0)

    def pre_hook(self, _module: Any, args: tuple) -> tuple:
        return (args[0] * self.ffn_scale.to(args[0].dtype), *args[1:])


def attach(
    chunk: Any, sites: PeftSites, settings: PeftSettings, config: Any, to: Attaching
) -> None:
    del config
    sp = to.sequence_parallel
    for base, layer in chosen_layers(chunk, sites, settings):
        own = layer.config
        kv = KeyValueScale(f"{base}.ia3_key_value", own, sp)
        to.add(layer, "ia3_key_value", kv, layer.self_attention.linear_qkv, kv.hook)
        cross = getattr(getattr(layer, "cross_attention", None), "linear_kv", None)
        if cross is not None:  # a decoder reading an encoder: its keys and values too
            cross_kv = KeyValueScale(f"{base}.ia3_cross_key_value", own, sp, False)
            to.add(layer, "ia3_cross_key_value", cross_kv, cross, cross_kv.hook)
        ffn = FfnScale(f"{base}.ia3_ffn", own, sp)
        to.add(layer, "ia3_ffn", ffn, layer.mlp.linear_fc2, ffn.pre_hook, pre=True)
