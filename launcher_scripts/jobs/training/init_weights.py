"""Weight initialisation that gives the same model at any tensor/pipeline-parallel layout.

megatron-core initialises layer by layer from one random stream, so the weights depend on how
the model is split (which layers a pipeline stage builds, how far the vocabulary is padded).
Here every tensor is drawn from a generator seeded by the run's seed and the tensor's global
name (its distributed-checkpoint key), in its global shape, and each rank keeps its slice. A
recipe then trains the same model whatever TP/PP it runs at, which is also what lets the tests
compare layouts. The distributions are GPT's: normal(0, std) for weights, std / sqrt(2 x layers)
for the projections that feed the residual stream, zero biases, unit (or, for layernorm1p,
zero) norm gains.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.transformer import TransformerConfig

from launcher_scripts.formats.safetensors_stream import TensorFile

RESIDUAL_OUTPUTS = ("linear_proj.weight", "linear_fc2.weight")
NORM_WEIGHTS = ("layer_norm_weight", "layernorm.weight", "norm.weight")


def sharded_tensors(state: Any) -> Iterator[ShardedTensor]:
    if isinstance(state, ShardedTensor):
        yield state
    elif isinstance(state, ShardedTensorFactory):
        yield from sharded_tensors(state.build())
    elif isinstance(state, dict):
        for value in state.values():
            yield from sharded_tensors(value)
    elif isinstance(state, list | tuple):
        for value in state:
            yield from sharded_tensors(value)


def model_tensors(chunks: list[torch.nn.Module]) -> Iterator[ShardedTensor]:
    """Each floating-point tensor of the chunks' sharded state dicts once (a tied weight appears
    twice), whole (not flattened), without extra state."""
    # Held, not just their ids: the views a ShardedTensorFactory builds (swiglu's two halves
    # of fc1) are new objects that die after use, and a later tensor could get a dead one's id
    # and be skipped. That happened now and then, depending on when the garbage collector ran,
    # and left a tensor with megatron's own initial values or without its loaded ones.
    seen: dict[int, torch.Tensor] = {}
    for chunk in chunks:
        for tensor in sharded_tensors(chunk.sharded_state_dict()):
            data = tensor.data
            if data is None or tensor.key.endswith("_extra_state") or not data.is_floating_point():
                continue
            if tensor.flattened_range is not None or id(data) in seen:
                continue
            seen[id(data)] = data
            yield tensor


def _global_values(tensor: ShardedTensor, config: TransformerConfig, seed: int, device: Any):
    name = tensor.key
    shape = tuple(tensor.global_shape)
    if name.endswith("bias"):
        return torch.zeros(shape, device=device)
    if any(name.endswith(suffix) for suffix in NORM_WEIGHTS):
        fill = 0.0 if config.layernorm_zero_centered_gamma else 1.0
        return torch.full(shape, fill, device=device)
    std = config.init_method_std
    if name.endswith(RESIDUAL_OUTPUTS):
        std /= math.sqrt(2.0 * config.num_layers)
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)


def initialize(chunks: list[torch.nn.Module], config: TransformerConfig, seed: int) -> None:
    """Overwrite every parameter of `chunks` with its layout-independent initial value."""
    assign_global(chunks, lambda tensor: _global_values(tensor, config, seed, tensor.data.device))


def load_full_tensors(
    chunks: list[torch.nn.Module],
    tensors: Mapping[str, torch.Tensor],
    wanted: Callable[[str], bool] | None = None,
) -> None:
    """Overwrite every parameter of `chunks` (or those whose key `wanted` accepts) with its
    slice of the full tensor of its key (what a portable checkpoint holds), whatever this
    rank's share of the layout. From a TensorFile, a stacked tensor's layers are read one at
    a time and only those of this rank: a pipeline stage reads its own layers, and no rank
    holds more than one layer's full tensor beyond its own parameters."""

    def local_value(tensor: ShardedTensor) -> torch.Tensor:
        if tensor.key not in tensors:
            raise KeyError(f"the weights have no tensor {tensor.key!r} this model needs")
        lazy = isinstance(tensors, TensorFile)
        shape = tensors.shape(tensor.key) if lazy else tuple(tensors[tensor.key].shape)
        if tuple(shape) != tuple(tensor.global_shape):
            raise ValueError(
                f"{tensor.key}: the weights have shape {tuple(shape)}, this model "
                f"{tuple(tensor.global_shape)}"
            )
        index = tensor.global_slice()
        if lazy and shape:
            rows = _leading_rows(index[0], shape[0])
            if rows is not None:
                first, last, keep_axis = rows
                part = tensors.read_rows(tensor.key, first, last)
                return part[(slice(None), *index[1:])] if keep_axis else part[0][index[1:]]
        return tensors[tensor.key][index]

    _assign_local(chunks, local_value, wanted)


def _leading_rows(first: int | slice, rows: int) -> tuple[int, int, bool] | None:
    """The rows an index's first element takes (first, last + 1, whether that axis stays),
    or None when they are not one run of rows."""
    if isinstance(first, int):
        return first, first + 1, False
    start, stop, step = first.indices(rows)
    return (start, stop, True) if step == 1 and stop >= start else None


def assign_global(
    chunks: list[torch.nn.Module],
    global_value: Callable[[ShardedTensor], torch.Tensor],
    wanted: Callable[[str], bool] | None = None,
) -> None:
    """Give each parameter (whose key `wanted` accepts) its slice of
    `global_value(sharded tensor)`, the full tensor."""
    _assign_local(chunks, lambda tensor: global_value(tensor)[tensor.global_slice()], wanted)


@torch.no_grad()
def _assign_local(
    chunks: list[torch.nn.Module],
    local_value: Callable[[ShardedTensor], torch.Tensor],
    wanted: Callable[[str], bool] | None = None,
) -> None:
    """Give each parameter (whose key `wanted` accepts) `local_value(sharded tensor)`, this
    rank's slice of it."""
    for tensor in model_tensors(chunks):
        if wanted is not None and not wanted(tensor.key):
            continue
        data = tensor.data
        local = local_value(tensor)
        data.copy_(local.reshape(data.shape).to(device=data.device, dtype=data.dtype))
