"""Every activation a recipe may name, or a portable file may hold, is one the training job can
build: the recipe checks, the file checks and the cost model name them in their own lists."""

from __future__ import annotations

import pytest

from launcher_scripts.families.encoder_checks import ENCODER_ACTIVATIONS
from launcher_scripts.formats.portable_check import GATED_ACTIVATIONS
from launcher_scripts.jobs.models.transformer import ACTIVATIONS
from launcher_scripts.recipes.training import ACTIVATIONS as GPT_RECIPE_ACTIVATIONS


@pytest.mark.parametrize(
    "allowed",
    [GATED_ACTIVATIONS, GPT_RECIPE_ACTIVATIONS, ENCODER_ACTIVATIONS],
    ids=["gated", "gpt-recipes", "encoder-recipes"],
)
def test_the_job_builds_every_allowed_activation(allowed: tuple[str, ...]) -> None:
    assert set(allowed) <= set(ACTIVATIONS), sorted(set(allowed) - set(ACTIVATIONS))
