"""The type and range of every number of a recipe's `model.optim` section, checked in preflight.

Training and the tuning stages share the section (NeMo's layout: name, lr, weight_decay,
betas, eps, and a `sched` with warmup/constant steps or a warm-up ratio and min_lr); the
training loop reads it with float()/int() when the job starts, so a word or a negative number
there failed on the cluster with a traceback. Pure Python (no torch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig

from launcher_scripts.config.checks import require_choice
from launcher_scripts.errors import ConfigError

OPTIMIZERS = ("fused_adam", "adam", "adamw", "distributed_fused_adam", "sgd")


def _number(
    key: str,
    value: Any,
    *,
    low: float,
    low_inclusive: bool,
    high: float | None = None,
    high_inclusive: bool = False,
    what: str,
) -> float:
    """A finite real number in the given range (booleans are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(key, f"{value!r} is not a number", f"Give {what}")
    above = value >= low if low_inclusive else value > low
    below = True if high is None else (value <= high if high_inclusive else value < high)
    if not (above and below):
        lower = f"{'>=' if low_inclusive else '>'} {low:g}"
        upper = "" if high is None else f" and {'<=' if high_inclusive else '<'} {high:g}"
        raise ConfigError(key, f"{value!r} is not {lower}{upper}", f"Give {what}")
    return float(value)


def _steps(key: str, value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            key, f"{value!r} is not a whole number of steps >= 0", "Give a step count, or 0"
        )
    return value


def _is_section(value: Any) -> bool:
    return isinstance(value, Mapping | DictConfig)


def check_optimizer(model: Any, stage: str) -> None:
    """Every optimizer and schedule number of `<stage>.model.optim` is of its type and range:
    lr > 0, weight_decay >= 0, two betas in [0, 1), eps > 0, whole warm-up and constant step
    counts >= 0, a warm-up ratio in [0, 1) and 0 <= min_lr <= lr."""
    prefix = f"{stage}.model.optim"
    optim = model.get("optim")
    if not _is_section(optim):
        raise ConfigError(prefix, f"{optim!r} is not a section", "Give name, lr, ... under it")
    require_choice(f"{prefix}.name", optim.get("name"), OPTIMIZERS)
    lr = _number(
        f"{prefix}.lr",
        optim.get("lr"),
        low=0,
        low_inclusive=False,
        what="the peak learning rate, e.g. 1e-4",
    )
    if optim.get("weight_decay") is not None:
        _number(
            f"{prefix}.weight_decay",
            optim.weight_decay,
            low=0,
            low_inclusive=True,
            what="the weight decay, e.g. 0.01 (0: none)",
        )
    betas = optim.get("betas")
    if betas is not None:
        if isinstance(betas, str | bytes) or not hasattr(betas, "__len__") or len(betas) != 2:
            raise ConfigError(
                f"{prefix}.betas",
                f"{betas!r} is not two numbers",
                f"Write {prefix}.betas=[0.9,0.95]",
            )
        for index, beta in enumerate(betas):
            _number(
                f"{prefix}.betas[{index}]",
                beta,
                low=0,
                low_inclusive=True,
                high=1,
                what="Adam's beta, a decay rate in [0, 1) such as 0.9 or 0.95",
            )
    if optim.get("eps") is not None:
        _number(
            f"{prefix}.eps", optim.eps, low=0, low_inclusive=False, what="a small number, e.g. 1e-8"
        )
    sched = optim.get("sched")
    if sched is None:
        return
    if not _is_section(sched):
        raise ConfigError(
            f"{prefix}.sched", f"{sched!r} is not a section", "Give name, ... under it"
        )
    _steps(f"{prefix}.sched.warmup_steps", sched.get("warmup_steps"))
    _steps(f"{prefix}.sched.constant_steps", sched.get("constant_steps"))
    if sched.get("warmup_ratio") is not None:
        _number(
            f"{prefix}.sched.warmup_ratio",
            sched.warmup_ratio,
            low=0,
            low_inclusive=True,
            high=1,
            what="the share of the steps spent warming up, e.g. 0.01",
        )
    if sched.get("min_lr") is not None:
        min_lr = _number(
            f"{prefix}.sched.min_lr",
            sched.min_lr,
            low=0,
            low_inclusive=True,
            what="the learning rate the schedule decays to (0 or more)",
        )
        if min_lr > lr:
            raise ConfigError(
                f"{prefix}.sched.min_lr",
                f"{min_lr:g} is above the peak learning rate lr {lr:g}",
                "Give a min_lr at most lr",
            )
