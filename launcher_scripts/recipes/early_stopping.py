"""Early stopping (NeMo's exp_manager.create_early_stopping_callback and
early_stopping_callback_params, Lightning's EarlyStopping): training ends when the monitored
validation metric has not improved for `patience` validations in a row.

    monitor     a validation metric the run logs: val_loss (pretraining), validation_loss or
                validation_<metric.name> (tuning)
    mode        min | max: which way is better
    min_delta   how much better a value must be to count as an improvement
    patience    validations without improvement before the run stops
    check_finite  stop at once when the metric is NaN or infinite

A stopped run saves its checkpoint and writes its outputs as a finished one does; its
checkpoint records the stop, so a rerun resumes to "already finished", and the counts are
kept in checkpoints, so a resumed run stops where an uninterrupted one would. Pure Python: the
stage checks the settings, the training loop keeps the count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from launcher_scripts.config.checks import require_int
from launcher_scripts.errors import ConfigError

SECTION = "exp_manager.early_stopping_callback_params"
OPTIONAL_KEYS = (
    "exp_manager.create_early_stopping_callback",
    *(
        f"{SECTION}.{name}"
        for name in (
            "monitor",
            "mode",
            "min_delta",
            "patience",
            "verbose",
            "strict",
            "check_finite",
        )
    ),
)


@dataclass(frozen=True)
class EarlyStopping:
    monitor: str
    mode: str
    min_delta: float
    patience: int
    check_finite: bool

    def update(self, state: dict[str, Any], value: float) -> str | None:
        """Count one validation whose monitored value is `value`, in `state` (the checkpoint's
        early_stopping record); the reason to stop, or None."""
        if self.check_finite and not math.isfinite(value):
            return f"{self.monitor} is {value}"
        best = state.get("best")
        better = best is None or (
            value < best - self.min_delta if self.mode == "min" else value > best + self.min_delta
        )
        if better:
            state.update(best=value, best_step=state.get("step"), wait=0)
            return None
        state["wait"] = int(state.get("wait", 0)) + 1
        if state["wait"] >= self.patience:
            return (
                f"{self.monitor} has not improved by {self.min_delta} for {self.patience} "
                f"validations (best {best:.6g} at step {state.get('best_step')})"
            )
        return None


def read_early_stopping(exp_manager: Mapping[str, Any], stage: str) -> EarlyStopping | None:
    enabled = exp_manager.get("create_early_stopping_callback", False)
    key = f"{stage}.exp_manager"
    if not isinstance(enabled, bool):
        raise ConfigError(
            f"{key}.create_early_stopping_callback", f"{enabled!r} is not true or false", "Fix it"
        )
    if not enabled:
        return None
    params = exp_manager.get("early_stopping_callback_params") or {}
    prefix = f"{stage}.{SECTION}"
    mode = params.get("mode", "min")
    if mode not in ("min", "max"):
        raise ConfigError(f"{prefix}.mode", f"{mode!r} is not min or max", "Fix it")
    delta = params.get("min_delta", 0.0)
    if isinstance(delta, bool) or not isinstance(delta, int | float) or delta < 0:
        raise ConfigError(f"{prefix}.min_delta", f"{delta!r} is not a number >= 0", "Fix it")
    monitor = params.get("monitor", "val_loss")
    if not isinstance(monitor, str) or not monitor:
        raise ConfigError(f"{prefix}.monitor", f"{monitor!r} is not a metric name", "e.g. val_loss")
    if params.get("strict", True) is False:
        raise ConfigError(
            f"{prefix}.strict",
            "is false: a monitor the run does not log would never stop it",
            "Leave it true (a monitor the run does not log is refused at its first validation)",
        )
    return EarlyStopping(
        monitor=monitor,
        mode=str(mode),
        min_delta=float(delta),
        patience=require_int(f"{prefix}.patience", params.get("patience", 3)),
        check_finite=bool(params.get("check_finite", True)),
    )
