"""A reward model's scalar head in place of a GPT model's output layer (the rlhf_rm stage
trains it; whoever opens a reward model's file builds it: jobs/conversion/load.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_tensor_for_checkpoint

from launcher_scripts.formats.portable import REWARD_HEAD


class RewardHead(MegatronModule):
    """GPTModel's output layer made a scalar: hidden states [s, b, h] -> rewards [s, b, 1].
    Whole on every tensor-parallel rank: the hidden states are whole there (gathered first
    under sequence parallelism), so each rank computes the same values and gradients."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.weight = torch.nn.Parameter(
            torch.zeros(1, config.hidden_size, dtype=config.params_dtype)
        )
        self.sequence_parallel = config.sequence_parallel  # GPTModel asks its output layer

    def forward(self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None):
        del weight, runtime_gather_output  # an output layer's arguments, not a head's
        if self.config.sequence_parallel:
            # Every rank computes the head and the loss on the whole sequence: the gradient
            # of its share is its own slice, not the sum over the ranks.
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return F.linear(hidden, self.weight), None

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None
    ) -> dict[str, Any]:
        """Under the output layer's entry (GPTModel looks it up) but named REWARD_HEAD: the
        checkpoint and the portable file tell it from a language model's output layer. A
        model saved under a prefix (PPO's critic: `critic.`) has its head under it too."""
        del metadata
        model_prefix = prefix.removesuffix("output_layer.")
        head = make_sharded_tensor_for_checkpoint(
            self.weight, model_prefix + REWARD_HEAD, prepend_offsets=sharded_offsets
        )
        return {f"{prefix}weight": head}


def with_reward_head(chunks: list[Any], config: Any) -> None:
    """The last pipeline stage's output layer replaced by a zero scalar head (the chunks
    were built without tied embeddings: the head shares nothing)."""
    for chunk in chunks:
        if chunk.post_process:
            chunk.output_layer = RewardHead(config)
