"""IA3: keys, values and the MLP's activations of each chosen layer scaled by learned
vectors."""

from __future__ import annotations

from typing import Any

from launcher_scripts.tuning.method import PeftMethod, PeftSettings, layers, register

NAME = "ia3"


def read(section: Any, key: str) -> PeftSettings:
    del key
    return PeftSettings(NAME, layer_selection=layers(section))


def check(settings: PeftSettings, key: str) -> None:
    del settings, key  # nothing beyond the layers, checked against the base model


register(
    PeftMethod(
        name=NAME,
        title="IA3",
        section="ia3_tuning",
        read=read,
        check=check,
        prefixes=("ia3_",),
        runtime="launcher_scripts.jobs.fine_tuning.methods.ia3",
        legacy_stage="ia3_learning",
    )
)
