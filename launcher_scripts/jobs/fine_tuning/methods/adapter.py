"""Adapters' modules: a bottleneck MLP added residually after a layer's attention and after
its MLP, out + W_out(act(W_in(norm(out)))), W_in column- and W_out row-parallel."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from megatron.core import tensor_parallel as tp

from launcher_scripts.errors import RecipeError
from launcher_scripts.jobs.fine_tuning.peft import (
    Attaching,
    PeftModule,
    PeftSites,
    chosen_layers,
    tp_size,
)
from launcher_scripts.tuning import PeftSettings

ADAPTER_ACTIVATIONS = {"swish": F.silu, "silu": F.silu, "gelu": F.gelu, "relu": F.relu}


class Adapter(PeftModule):
    """A bottleneck MLP added residually to a block's output (attention or MLP)."""

    def __init__(self, key: str, hidden: int, s: PeftSettings, sp: bool) -> None:
        super().__init__(key, sp)
        ranks = tp_size()
        if s.rank % ranks:
            raise RecipeError(
                f"adapter_dim {s.rank} does not split over tensor_model_parallel_size {ranks}"
            )
        self.norm_position, self.dropout = s.norm_position, s.dropout
        self.activation = ADAPTER_ACTIVATIONS[s.activation]
        self.add("linear_in", (s.rank // ranks, hidden), s.column_init, 0)
        self.add("linear_out", (hidden, s.rank // ranks), s.row_init, 1)
        if s.norm_position:
            self.add("norm_weight", (hidden,), "ones", None)
            self.add("norm_bias", (hidden,), "zero", None)
        # The norm runs on this rank's tokens: its gradients need the TP all-reduce only then.

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = (x.shape[-1],)
        if self.norm_position == "pre":
            x = F.layer_norm(x, size, self.norm_weight, self.norm_bias)
        full = (
            tp.gather_from_sequence_parallel_region(x)
            if self.sequence_parallel
            else tp.copy_to_tensor_model_parallel_region(x)
        )
        hidden = self.activation(F.linear(full, self.linear_in))
        partial = F.linear(F.dropout(hidden, self.dropout, self.training), self.linear_out)
        out = (
            tp.reduce_scatter_to_sequence_parallel_region(partial)
            if self.sequence_parallel
            else tp.reduce_from_tensor_model_parallel_region(partial)
        )
        if self.norm_position == "post":
            out = F.layer_norm(out, size, self.norm_weight, self.norm_bias)
        return out

    def hook(self, _module: Any, _args: tuple, output: Any) -> Any:
        out, bias = output
        full = out + bias if bias is not None else out
        return out + self(full.to(self.linear_in.dtype)).to(out.dtype), bias


def attach(
    chunk: Any, sites: PeftSites, settings: PeftSettings, config: Any, to: Attaching
) -> None:
    del config
    for base, layer in chosen_layers(chunk, sites, settings):
        places = (("attention", layer.self_attention.linear_proj), ("mlp", layer.mlp.linear_fc2))
        for place, linear in places:
            hidden = layer.config.hidden_size
            adapter = Adapter(f"{base}.adapter_{place}", hidden, settings, to.sequence_parallel)
            to.add(layer, f"adapter_{place}", adapter, linear, adapter.hook)
