"""launcher_scripts.jobs.training.init_weights.model_tensors: every tensor of the sharded state
dicts once, including the two halves of a gated (swiglu) fc1, whose views megatron-core's
ShardedTensorFactory builds anew each time and which die after use."""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

from launcher_scripts.jobs.training.init_weights import assign_global, model_tensors


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
