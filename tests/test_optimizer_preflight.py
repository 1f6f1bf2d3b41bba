"""Every number of `model.optim` is checked in preflight, for training and the tuning stages.

`training.model.optim.lr=fast` used to pass the dry run and fail in the job with a traceback
(`float('fast')`); `lr=-1` trained with a negative learning rate.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launcher_scripts import pipeline
from launcher_scripts.config.compose import compose_config
from launcher_scripts.config.preflight import resolve
from launcher_scripts.errors import ConfigError
from launcher_scripts.recipes.optimizer import check_optimizer
from tests.support.commands import assert_one_line_error, run_main
from tests.support.recipe_fills import FILLS

# A recipe of each family for each stage that has an optimizer.
RECIPES = [
    ("training", "gpt3/tiny"),
    ("training", "t5/220m"),
    ("training", "bert/110m"),
    ("fine_tuning", "gpt3/squad"),
    ("fine_tuning", "t5/squad"),
    ("peft", "gpt3/squad"),
    ("prompt_learning", "gpt3/squad"),
    ("prompt_learning", "mt5/squad"),
    ("adapter_learning", "gpt3/squad"),
    ("ia3_learning", "t5/squad"),
]

# (key within model.optim, a bad value, what the line says)
BAD = [
    ("lr", "fast", "is not a number"),
    ("lr", -1, "is not > 0"),
    ("lr", 0, "is not > 0"),
    ("lr", float("inf"), "is not a number"),
    ("lr", True, "is not a number"),
    ("weight_decay", "none", "is not a number"),
    ("weight_decay", -0.1, "is not >= 0"),
    ("betas", [0.9], "is not two numbers"),
    ("betas", "0.9,0.95", "is not two numbers"),
    ("betas", [0.9, 1.5], "is not >= 0 and < 1"),
    ("betas", [-0.1, 0.9], "is not >= 0 and < 1"),
    ("eps", 0, "is not > 0"),
    ("eps", "tiny", "is not a number"),
    ("sched.warmup_steps", "x", "whole number of steps"),
    ("sched.warmup_steps", -5, "whole number of steps"),
    ("sched.warmup_steps", 2.5, "whole number of steps"),
    ("sched.constant_steps", "x", "whole number of steps"),
    ("sched.warmup_ratio", 2, "is not >= 0 and < 1"),
    ("sched.min_lr", "fast", "is not a number"),
    ("sched.min_lr", -1e-5, "is not >= 0"),
    ("sched.min_lr", 10.0, "is above the peak learning rate"),
]


def resolved_model(group: str, recipe: str) -> dict:
    cfg = compose_config([f"{group}={recipe}", *FILLS.get((group, recipe), [])])
    model = OmegaConf.to_container(resolve(cfg, [group])[group].model)
    assert isinstance(model, dict)
    return model


@pytest.mark.parametrize(("group", "recipe"), RECIPES)
def test_every_optimizer_number_is_checked(group: str, recipe: str) -> None:
    model = resolved_model(group, recipe)
    check_optimizer(OmegaConf.create(model), group)  # the shipped values pass
    for path, value, problem in BAD:
        broken = copy.deepcopy(model)
        section = broken["optim"]
        *parents, name = path.split(".")
        for part in parents:
            section = section.setdefault(part, {})
        section[name] = value
        with pytest.raises(ConfigError) as error:
            check_optimizer(OmegaConf.create(broken), group)
        message = str(error.value)
        assert error.value.key.startswith(f"{group}.model.optim.{path}"), message
        assert problem in message, message


@pytest.mark.parametrize(("group", "recipe"), RECIPES)
def test_the_preflight_of_each_stage_checks_the_optimizer(
    group: str, recipe: str, tmp_path: Path
) -> None:
    """A dry run of the stage refuses a word for the learning rate, before any job."""
    overrides = [
        f"stages=[{group}]",
        f"{group}={recipe}",
        *FILLS.get((group, recipe), []),
        f"{group}.model.optim.lr=fast",
        f"base_results_dir={tmp_path}/results",
        "dry_run=true",
    ]
    with pytest.raises(ConfigError) as error:
        pipeline.plan(compose_config(overrides))
    assert error.value.key == f"{group}.model.optim.lr", str(error.value)


@pytest.mark.parametrize("value", ["fast", "-1"])
def test_the_issues_learning_rates_are_one_line(value: str, tmp_path: Path) -> None:
    results = tmp_path / "results"
    result = run_main(
        "stages=[training]", f"base_results_dir={results}", f"training.model.optim.lr={value}"
    )
    assert_one_line_error(result, "training.model.optim.lr")
    assert not results.exists()
