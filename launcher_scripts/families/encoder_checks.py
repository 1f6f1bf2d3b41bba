"""Checks the encoder families (T5, BERT) share: the NeMo launcher's encoder recipes take
other activations, schedulers and tokenizers than GPT's, and mask tokens for their loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from launcher_scripts.config.checks import require_choice
from launcher_scripts.errors import ConfigError
from launcher_scripts.recipes import training as recipe
from launcher_scripts.recipes.layout import read_layout
from launcher_scripts.recipes.optimizer import check_optimizer
from launcher_scripts.recipes.training import key

# The activations NeMo's encoder models accept (megatron's names).
ENCODER_ACTIVATIONS = (
    "gelu",
    "geglu",
    "reglu",
    "swiglu",
    "relu",
    "squared-relu",
    "fast-geglu",
    "fast-reglu",
    "fast-swiglu",
    # GeGLU with the tanh approximation of GeLU: T5 v1.1's and mT5's (Hugging Face's "gated-gelu")
    "geglu-tanh",
)
ENCODER_SCHEDULERS = (
    "CosineAnnealing",
    "WarmupAnnealing",
    "constant",
    "InverseSquareRootAnnealing",
)
WORDPIECE_TYPES = ("BertWordPieceCase", "BertWordPieceLowerCase")


def masked_lm(model: Any, stage: str) -> None:
    probability = model.data.get("masked_lm_prob")
    if not isinstance(probability, float) or not 0 < probability < 1:
        raise ConfigError(
            key(stage, "model.data.masked_lm_prob"),
            f"{probability!r} is not a fraction in (0, 1)",
            "Use e.g. 0.15",
        )


def _encoder_schedule(cfg: Any, stage: str) -> None:
    sched = recipe.section(cfg.model.optim, "sched")
    require_choice(
        key(stage, "model.optim.sched.name"), sched.get("name", "constant"), ENCODER_SCHEDULERS
    )


def _wordpiece_or_sentencepiece(cfg: Any, stage: str) -> None:
    tokenizer = cfg.model.tokenizer
    if tokenizer.get("library") == "megatron":
        require_choice(key(stage, "model.tokenizer.type"), tokenizer.get("type"), WORDPIECE_TYPES)


def common_checks(cfg: Any, stage: str, will_exist: Callable[[str], bool]) -> None:
    """What every family shares after its layout checks: batch, precision, trainer, inputs."""
    model = cfg.model
    check_optimizer(model, stage)
    layout = read_layout(cfg, stage)
    recipe.check_batch(model, layout, stage)
    recipe.precision(cfg, stage)
    recipe.check_trainer(cfg, stage)
    recipe.rendezvous_timeout(cfg, stage)
    masked_lm(model, stage)
    _encoder_schedule(cfg, stage)
    _wordpiece_or_sentencepiece(cfg, stage)
    recipe.check_inputs(cfg, stage, will_exist)
