"""Mends for megatron-core 0.16 defects this launcher's jobs meet, each applied where it is
needed (idempotent) and each naming the defect, so that each can go when megatron-core fixes it.
"""

from __future__ import annotations

from typing import Any

from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.transformer.moe import moe_utils

_ORIGINAL_SET_STATES = DistributedOptimizer._set_main_param_and_optimizer_states


def moe_without_te() -> None:
    """moe_utils binds `te_general_gemm` only when Transformer Engine imports, then tests it
    against None in the router's fp32 gating: a NameError without Transformer Engine."""
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _set_states_present(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
    """The original, given only the states a checkpoint holds for the parameter. torch's Adam
    (what runs without Apex or Transformer Engine) keeps a per-parameter "step", which the
    per-parameter checkpoint formats leave out (they restore it from the parameter groups)
    and then ask for: a KeyError on every resume."""
    group_index, group_order = self.model_param_group_index_map[model_param]
    main_param = self.optimizer.param_groups[group_index]["params"][group_order]
    state = self.optimizer.state[main_param]
    if "step" in state and "step" not in tensors:
        tensors = {**tensors, "step": state["step"]}
    _ORIGINAL_SET_STATES(self, model_param, tensors)


def torch_adam_resumes_per_parameter() -> None:
    """See _set_states_present."""
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_states_present
