"""What the dpo stage's recipe asks of its loss (`model.dpo`), read and checked before any job.

    model.dpo.ref_policy_kl_penalty   beta: how far the policy may move from the reference
    model.dpo.preference_loss         sigmoid (DPO) | ipo
    model.dpo.label_smoothing         sigmoid: the share of pairs taken as mislabelled (cDPO)
    model.dpo.sft_loss_weight         > 0: plus that weight x the chosen answer's mean
                                      negative log-likelihood (RPO)
    model.dpo.reference_model         null: the starting policy is the reference; else a
                                      portable file of the same architecture and tokenizer

Pure Python: the launcher's preflight and the job program read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher_scripts.errors import RecipeError

LOSSES = ("sigmoid", "ipo")
# model.dpo's keys (all read with a default).
DPO_KEYS = (
    "ref_policy_kl_penalty",
    "preference_loss",
    "label_smoothing",
    "sft_loss_weight",
    "reference_model",
)


@dataclass(frozen=True)
class DpoSettings:
    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0
    sft_loss_weight: float = 0.0
    reference: Path | None = None
    reference_key: str = ""  # the recipe key naming the reference file, for messages

    def models(self) -> list[tuple[str, Path]]:
        """(recipe key, path) of the model files it reads beside the base: each must be the
        base's architecture with its tokenizer."""
        return [(self.reference_key, self.reference)] if self.reference else []


def read_dpo(cfg: Any, stage: str) -> DpoSettings:
    section = cfg.model.get("dpo") or {}
    key = f"{stage}.model.dpo"
    beta = float(section.get("ref_policy_kl_penalty", 0.1))
    if not beta > 0:
        raise RecipeError(
            f"{key}.ref_policy_kl_penalty: {beta} must be above 0 (beta: larger keeps the "
            "policy nearer the reference; 0.1 is usual)"
        )
    loss = str(section.get("preference_loss") or "sigmoid")
    if loss not in LOSSES:
        raise RecipeError(f"{key}.preference_loss: {loss!r} is not one of {', '.join(LOSSES)}")
    smoothing = float(section.get("label_smoothing") or 0.0)
    if not 0.0 <= smoothing < 0.5:
        raise RecipeError(f"{key}.label_smoothing: {smoothing} must be in [0, 0.5)")
    if smoothing and loss != "sigmoid":
        raise RecipeError(f"{key}.label_smoothing: {smoothing} applies to the sigmoid loss only")
    sft = float(section.get("sft_loss_weight") or 0.0)
    if sft < 0:
        raise RecipeError(f"{key}.sft_loss_weight: {sft} must be 0 or more")
    data = cfg.model.get("data") or {}
    micro = int(cfg.model.get("micro_batch_size") or 1)
    if data.get("packed_sequence") and micro % 2:
        raise RecipeError(
            f"{stage}.model.micro_batch_size: {micro} packed sequences, and the reference pass "
            "and validation read pairs unpacked, two sequences to a micro-batch: give an even "
            "micro_batch_size"
        )
    reference = section.get("reference_model")
    return DpoSettings(
        beta=beta,
        loss=loss,
        label_smoothing=smoothing,
        sft_loss_weight=sft,
        reference=Path(str(reference)) if reference else None,
        reference_key=f"{key}.reference_model",
    )
