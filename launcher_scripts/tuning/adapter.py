"""Adapters: a bottleneck MLP added residually after each chosen layer's attention and MLP."""

from __future__ import annotations

from typing import Any

from launcher_scripts.config.checks import require_int
from launcher_scripts.errors import RecipeError
from launcher_scripts.tuning.method import PeftMethod, PeftSettings, layers, register

NAME = "adapter"
ADAPTER_ACTIVATIONS = ("swish", "silu", "gelu", "relu")


def read(section: Any, key: str) -> PeftSettings:
    norm = section.get("norm_position", "pre")
    return PeftSettings(
        scheme=NAME,
        rank=require_int(f"{key}.adapter_dim", section.get("adapter_dim", 32)),
        dropout=float(section.get("adapter_dropout") or 0.0),
        column_init=str(section.get("column_init_method") or "xavier"),
        row_init=str(section.get("row_init_method") or "zero"),
        norm_position=None if norm in (None, "none") else str(norm),
        activation=str(section.get("activation") or "swish"),
        layer_selection=layers(section),
    )


def check(settings: PeftSettings, key: str) -> None:
    if settings.rank < 1:
        raise RecipeError(f"{key}.adapter_dim must be at least 1, not {settings.rank}")
    if settings.norm_position not in ("pre", "post", None):
        raise RecipeError(f"{key}.norm_position must be pre, post or null")
    if settings.activation not in ADAPTER_ACTIVATIONS:
        raise RecipeError(f"{key}.activation must be one of {', '.join(ADAPTER_ACTIVATIONS)}")


register(
    PeftMethod(
        name=NAME,
        title="adapter",
        section="adapter_tuning",
        read=read,
        check=check,
        prefixes=("adapter_",),
        runtime="launcher_scripts.jobs.fine_tuning.methods.adapter",
        optional_keys=("activation", "layer_selection"),
        legacy_stage="adapter_learning",
        legacy_section="adapter_tuning",
    )
)
