"""launcher_scripts.jobs.training.init_weights.model_tensors: every tensor of the sharded state
dicts once, including the two halves of a gated (swiglu) fc1, whose views megatron-core's
ShardedTensorFactory builds anew each time and which die after use."""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

from launcher_scripts.formats.safetensors_stream import StreamedTensor, TensorFile, write
from launcher_scripts.jobs.training.init_weights import (
    assign_global,
    load_full_tensors,
    model_tensors,
)


class GatedLayers(torch.nn.Module):
    """Stands for model chunks holding several swiglu fc1 weights (and one tied twice)."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(8, 4)) for _ in range(layers)
        )
        self.embedding = torch.nn.Parameter(torch.zeros(16, 4))

    def sharded_state_dict(self) -> dict:
        state: dict = {}
        for index, weight in enumerate(self.fc1):
            key = f"layers.{index}.mlp.linear_fc1.weight"
            plain = ShardedTensor.from_rank_offsets(key, weight, replica_id=0)
            state[key] = apply_swiglu_sharded_factory(plain, ())
        for key in ("embedding.weight", "output_layer.weight"):  # tied: one tensor, two keys
            state[key] = ShardedTensor.from_rank_offsets(key, self.embedding, replica_id=0)
        return state


def test_every_half_of_every_gated_weight_is_visited_once() -> None:
    layers = GatedLayers(64)
    visited = [(tensor.key, tensor.global_offset) for tensor in model_tensors([layers])]
    expected = [
        (f"layers.{index}.mlp.linear_fc1.weight", (offset, 0))
        for index in range(64)
        for offset in (0, 4)
    ]
    assert visited == [*expected, ("embedding.weight", (0, 0))]  # the tied repeat left out


@torch.no_grad()
def test_assign_global_gives_every_weight_its_values() -> None:
    layers = GatedLayers(64)
    assign_global([layers], lambda tensor: torch.full(tuple(tensor.global_shape), 1.0))
    assert all(bool((weight == 1.0).all()) for weight in [*layers.fc1, layers.embedding])


class StackedLayers(torch.nn.Module):
    """Stands for a pipeline stage holding layers `first`..`first + count - 1` of a stack of
    `total`, as megatron-core keys them: one stacked tensor per weight, a layer axis first."""

    def __init__(self, first: int, count: int, total: int) -> None:
        super().__init__()
        self.first, self.total = first, total
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(6, 4)) for _ in range(count)
        )

    def sharded_state_dict(self) -> dict:
        return {
            f"layer{index}": ShardedTensor.from_rank_offsets(
                "decoder.layers.linear_fc1.weight",
                weight,
                (0, self.first + index, self.total),
                replica_id=0,
                prepend_axis_num=1,
            )
            for index, weight in enumerate(self.weights)
        }


class CountingFile(TensorFile):
    def __init__(self, path) -> None:  # type: ignore[no-untyped-def]
        super().__init__(path)
        self.rows_read = 0

    def read_rows(self, name: str, first: int, last: int) -> torch.Tensor:
        self.rows_read += last - first
        return super().read_rows(name, first, last)


@torch.no_grad()
def test_a_stage_reads_only_its_own_layers_of_a_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """From a file, a pipeline stage holding layers 2 and 3 of 5 reads those two layers'
    rows of the stacked tensor, and gets the values the whole tensor gives."""
    stacked = torch.arange(5 * 6 * 4, dtype=torch.float32).reshape(5, 6, 4)
    path = tmp_path / "weights.safetensors"
    write(path, [StreamedTensor.whole("decoder.layers.linear_fc1.weight", stacked)])
    source = CountingFile(path)
    stage = StackedLayers(first=2, count=2, total=5)
    load_full_tensors([stage], source)
    assert source.rows_read == 2
    assert all(bool((w == stacked[2 + i]).all()) for i, w in enumerate(stage.weights))
    from_memory = StackedLayers(first=2, count=2, total=5)
    load_full_tensors([from_memory], {"decoder.layers.linear_fc1.weight": stacked})
    assert all(
        bool((a == b).all()) for a, b in zip(stage.weights, from_memory.weights, strict=True)
    )
