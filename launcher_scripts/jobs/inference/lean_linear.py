"""megatron-core's local tensor-parallel linear layers with an inference-only forward.

In training, megatron-core's ColumnParallelLinear and RowParallelLinear run their matrix
multiply through autograd Functions (for the weight-gradient fusions and the overlapped
all-reduce of the input gradient) and mark the TP boundary with identity Functions
(`copy_to_tensor_model_parallel_region`, `reduce_from_...`). A decoding step of a small model
makes about 20 such calls; each costs an autograd node's bookkeeping even under inference
mode, together about a fifth of the step on a CPU. At inference nothing needs them: the
forward is the same product, the same bias and, at TP > 1, the same gather or all-reduce.

Installed per module, only on a model opened for inference (a served or evaluated model,
never one being trained), and only where the forward computes exactly that: no sequence
parallelism (whose forward gathers and scatters the sequence), no expert communication, no
deferred embedding gradients, no activation offloading. Adapters attached as forward hooks
(LoRA) still run: the hooks sit on the module, not in its forward.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812


def _column_forward(
    self: Any,
    input_: torch.Tensor,
    weight: torch.Tensor | None = None,
    runtime_gather_output: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = self.weight if weight is None else weight
    output = F.linear(input_, weight, None if self.skip_bias_add else self.bias)
    gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
    if gather and self.lean_group.size() > 1:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        output = gather_from_tensor_model_parallel_region(output, group=self.lean_group)
    return output, (self.bias if self.skip_bias_add else None)


def _row_forward(self: Any, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    output = F.linear(input_, self.weight)
    if self.lean_group.size() > 1:
        torch.distributed.all_reduce(output, group=self.lean_group)
    if self.skip_bias_add:
        return output, self.bias
    return (output + self.bias if self.bias is not None else output), None


def _plain(module: Any) -> bool:
    config = module.config
    return (
        not module.sequence_parallel
        and not getattr(module, "explicit_expert_comm", False)
        and not getattr(config, "defer_embedding_wgrad_compute", False)
        and getattr(config, "_cpu_offloading_context", None) is None
    )


def lean_linears(chunks: list[Any]) -> int:
    """Give each plain local TP linear layer of the chunks the inference forward; how many."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    default_group = parallel_state.get_tensor_model_parallel_group()
    replaced = 0
    for chunk in chunks:
        for module in chunk.modules():
            if type(module) is ColumnParallelLinear and _plain(module):
                module.forward = types.MethodType(_column_forward, module)
            elif type(module) is RowParallelLinear and module.input_is_parallel and _plain(module):
                module.forward = types.MethodType(_row_forward, module)
            else:
                continue
            # The layer's own TP group where it keeps one (megatron-core >= 0.15).
            module.lean_group = getattr(module, "tp_group", None) or default_group
            replaced += 1
    return replaced
