"""Prompt tuning and P-tuning: the first `virtual_tokens` positions take learned embeddings
(P-tuning: produced by an MLP from learned inputs). Two methods on one torch side."""

from __future__ import annotations

from typing import Any

from launcher_scripts.config.checks import require_int
from launcher_scripts.errors import RecipeError
from launcher_scripts.tuning.method import PeftMethod, PeftSettings, register

PROMPT_ENCODERS = ("mlp", "tpmlp")
RUNTIME = "launcher_scripts.jobs.fine_tuning.methods.prompt"
PTUNING = "ptuning"


def encodes(settings: PeftSettings) -> bool:
    """Whether the virtual tokens come out of a prompt encoder (P-tuning) rather than being
    learned as they are."""
    return settings.scheme == PTUNING


ENCODER_KEYS = ("encoder_hidden", "bottleneck_dim", "num_layers", "encoder_type", "dropout")


def _reader(name: str) -> Any:
    def read(section: Any, key: str) -> PeftSettings:
        return PeftSettings(
            scheme=name,
            virtual_tokens=require_int(f"{key}.virtual_tokens", section.get("virtual_tokens", 10)),
            encoder_hidden=int(
                section.get("encoder_hidden") or section.get("bottleneck_dim") or 1024
            ),
            encoder_layers=int(section.get("num_layers") or 2),
            encoder_type=str(section.get("encoder_type") or "mlp"),
            init_std=float(section.get("init_std") or 0.023),
            dropout=float(section.get("dropout") or 0.0),
        )

    return read


def check_tokens(settings: PeftSettings, key: str) -> None:
    if settings.virtual_tokens < 1:
        raise RecipeError(f"{key}: {settings.scheme} needs at least one virtual token")


def check_encoded(settings: PeftSettings, key: str) -> None:
    check_tokens(settings, key)
    if settings.encoder_type not in PROMPT_ENCODERS:
        raise RecipeError(
            f"{key}.p_tuning.encoder_type: {settings.encoder_type!r}: this version has "
            f"{', '.join(PROMPT_ENCODERS)} (an MLP prompt encoder)"
        )
    if settings.encoder_layers < 1:
        raise RecipeError(f"{key}.num_layers: the prompt encoder needs at least one layer")


register(
    PeftMethod(
        name=PTUNING,
        title="P-tuning",
        section="p_tuning",
        read=_reader(PTUNING),
        check=check_encoded,
        prefixes=("virtual_prompt",),
        runtime=RUNTIME,
        optional_keys=ENCODER_KEYS,
        legacy_stage="prompt_learning",
        legacy_section="p_tuning",
        legacy_style="p-tuning",
    )
)
register(
    PeftMethod(
        name="prompt_tuning",
        title="prompt tuning",
        section="p_tuning",
        read=_reader("prompt_tuning"),
        check=check_tokens,
        prefixes=("virtual_prompt",),
        runtime=RUNTIME,
        optional_keys=ENCODER_KEYS,
        legacy_stage="prompt_learning",
        legacy_style="prompt-tuning",
    )
)
