"""LoRA's modules: a low-rank update beside each adapted linear, computed under tensor
parallelism the way the linear is split,

  on a column-parallel linear (qkv, fc1):  delta = B_shard(copy(A x))
  on a row-parallel linear (proj, fc2):    delta = B(reduce(A_shard x_shard))

and its merge into the base weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from megatron.core import tensor_parallel as tp

from launcher_scripts.jobs.fine_tuning.peft import (
    PEFT_SEGMENT,
    Attaching,
    MergeError,
    PeftModule,
    PeftSites,
    chosen_layers,
    tp_size,
)
from launcher_scripts.tuning import PeftSettings
from launcher_scripts.tuning.lora import LORA_LINEARS

# target -> (module, linear, how megatron-core splits the linear over TP). Layers without a
# cross-attention (GPT's, an encoder's) have none of the cross_attention_* linears.
LORA_TARGETS = {
    target: (owner, linear, "row" if linear in ("linear_proj", "linear_fc2") else "column")
    for target, (owner, linear) in LORA_LINEARS.items()
}


class Lora(PeftModule):
    def __init__(
        self, key: str, linear: Any, style: str, s: PeftSettings, sp: bool, gated: bool = False
    ) -> None:
        super().__init__(key, sp)
        self.style, self.scale, self.dropout = style, s.alpha / s.rank, s.dropout
        ranks = tp_size()
        if style == "column":  # A whole, B split by output rows (a gated fc1's as fc1's)
            self.add("lora_a", (s.rank, linear.input_size), s.column_init, None)
            self.add("lora_b", (linear.output_size // ranks, s.rank), s.row_init, 0)
            if gated:
                self.gated_rows.add("lora_b")
        else:  # A split by input columns, B whole
            self.add("lora_a", (s.rank, linear.input_size // ranks), s.column_init, 1)
            self.add("lora_b", (linear.output_size, s.rank), s.row_init, None)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        x = F.dropout(x, self.dropout, self.training)
        hidden = F.linear(x.to(self.lora_a.dtype), self.lora_a)
        if self.style == "column":
            hidden = (
                tp.gather_from_sequence_parallel_region(hidden)
                if self.sequence_parallel
                else tp.copy_to_tensor_model_parallel_region(hidden)
            )
        else:
            hidden = (
                tp.reduce_scatter_to_sequence_parallel_region(hidden)
                if self.sequence_parallel
                else tp.reduce_from_tensor_model_parallel_region(hidden)
            )
        return F.linear(hidden, self.lora_b) * self.scale

    def hook(self, _module: Any, args: tuple, output: Any) -> Any:
        out, bias = output
        return out + self.delta(args[0]).to(out.dtype), bias


def attach(
    chunk: Any, sites: PeftSites, settings: PeftSettings, config: Any, to: Attaching
) -> None:
    del config
    for base, layer in chosen_layers(chunk, sites, settings):
        for target in settings.target_modules:
            owner, linear_name, style = LORA_TARGETS[target]
            linear = getattr(getattr(layer, owner, None), linear_name, None)
            if linear is None:
                continue
            gated = target == "mlp_fc1" and bool(layer.config.gated_linear_unit)
            lora = Lora(f"{base}.{target}", linear, style, settings, to.sequence_parallel, gated)
            to.add(layer, f"lora_{target}", lora, linear, lora.hook)


def base_weight(key: str) -> tuple[str, int]:
    """A LoRA tensor's key -> (the base weight it adapts, stacked over layers: [layers, out,
    in]; the layer's index there). Keys are `peft.[<stack>.]<layer number>.<target>.lora_a`:
    a decoder stack's layers have no stack name, an encoder-decoder's say which (T5's
    encoder. and decoder.)."""
    *stack, number, target = key.split(PEFT_SEGMENT, 1)[1].removesuffix(".lora_a").split(".")
    owner, linear = LORA_LINEARS[target]
    return f"{'.'.join(stack) or 'decoder'}.layers.{owner}.{linear}.weight", int(number) - 1


def merged(
    tensors: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], settings: PeftSettings
) -> dict[str, torch.Tensor]:
    """The base tensors with every LoRA update added (new tensors; the inputs are unchanged)."""
    out = dict(tensors)
    scale = settings.alpha / settings.rank
    for key, a in lora.items():
        if not key.endswith(".lora_a"):
            continue
        base_key, index = base_weight(key)
        if base_key not in out:
            raise MergeError(f"the base model has no {base_key} for {key}")
        if index >= out[base_key].shape[0]:
            raise MergeError(
                f"{key} adapts layer {index + 1}, but the base model's {base_key} has "
                f"{out[base_key].shape[0]} layers: was the PEFT file tuned on this base model?"
            )
        b = lora[key.removesuffix("lora_a") + "lora_b"]
        if out[base_key] is tensors[base_key]:  # first update of this weight: copy it
            out[base_key] = tensors[base_key].clone()
        weights = out[base_key]
        update = (b.double() @ a.double()) * scale
        if tuple(update.shape) != tuple(weights[index].shape):
            raise MergeError(
                f"{key}: the update has shape {tuple(update.shape)}, the base weight "
                f"{tuple(weights[index].shape)}: was the PEFT file tuned on this base model?"
            )
        weights[index] = (weights[index].double() + update).to(weights.dtype)
    return out
