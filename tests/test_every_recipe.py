"""The whole recipe tree: every recipe of every stage group composes, passes preflight and
renders its scripts, on the local backend and on a cluster backend (each cluster type in turn):
a dry run's planning, in process (nothing is written, run or submitted).

Inputs a recipe reads (datasets, tokenizers) need not exist: a dry run lists the missing ones
and goes on with every other check, so a recipe whose settings are wrong still fails here.
Checkpoints come from the stages that write them, put before the stage in the same run.
On the local backend a recipe of several nodes is refused, after every other check passed.
New recipes, stage groups and cluster types are picked up without edits.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import pytest
import yaml
from omegaconf import DictConfig, OmegaConf

from launcher_scripts.clusters import BACKENDS
from launcher_scripts.config.compose import compose_config, config_groups, recipe_options
from launcher_scripts.errors import ConfigError
from launcher_scripts.pipeline import plan
from launcher_scripts.stages import STAGES
from tests.support import REPO
from tests.support.dry_runs import without_slurm
from tests.support.recipe_fills import FILLS

GROUPS = [group for group in config_groups() if group != "cluster"]
RUNNABLE = [group for group in GROUPS if group in STAGES]
IMAGE = "nvcr.io/nvidia/nemo:24.05"


def backend_cases(groups: list[str]) -> list[tuple[str, str, str]]:
    """Each recipe on the local backend and on one cluster backend, taken in turn along the
    recipes (and shifted from group to group), so that every cluster backend renders recipes
    of every stage group without every recipe rendering four times: the backends' own
    rendering of each stage is the golden scripts' and the quoting tests' subject."""
    clusters = [c for c in BACKENDS if c != "local"]
    found = []
    for shift, group in enumerate(groups):
        for index, recipe in enumerate(recipe_options(group)):
            cluster = clusters[(index + shift) % len(clusters)]
            found += [(group, recipe, "local"), (group, recipe, cluster)]
    return found


# The stages whose outputs a stage reads: they run before it in the test's run, so its inputs
# are ones "an earlier stage of this run writes" and need no real checkpoint.
UPSTREAM = {"conversion": ("training",), "evaluation": ("training", "conversion")}
UPSTREAM["export"] = UPSTREAM["evaluation"]
# Recipes whose input an earlier stage of the same run writes, by stage.
WRITTEN_BEFORE = {("data_preparation", "generic/curated"): ("data_curation",)}


@functools.cache
def recipe_alone(group: str, recipe: str) -> DictConfig:
    """A recipe composed by itself (its stage's group only), once per worker: the cases of a
    recipe on two backends and the recipes reading it share it."""
    return compose_config(
        [f"stages=[{group}]", f"{group}={recipe}", *FILLS.get((group, recipe), [])]
    )[group]


def family(group: str, recipe: str) -> str:
    return str(recipe_alone(group, recipe).get("model_family", "gpt"))


@functools.cache
def training_recipes_by_run_name() -> dict[str, str]:
    return {
        str(OmegaConf.select(recipe_alone("training", recipe), "run.name")): recipe
        for recipe in recipe_options("training")
    }


@functools.cache
def recipe_of_family(group: str, wanted: str) -> str:
    for recipe in recipe_options(group):
        if family(group, recipe) == wanted:
            return recipe
    raise AssertionError(f"no {group} recipe for {wanted} models")


@functools.cache
def upstream(group: str, recipe: str) -> tuple[str, ...]:
    """Overrides that put the run producing this recipe's inputs before it: the training run it
    names (run.model_train_name) and, where needed, a conversion of the same family."""
    if (group, recipe) in WRITTEN_BEFORE:
        return (f"stages=[{','.join((*WRITTEN_BEFORE[group, recipe], group))}]",)
    target = recipe_alone(group, recipe)
    trained = training_recipes_by_run_name().get(str(target.run.get("model_train_name")))
    if group not in UPSTREAM or trained is None:
        return (f"stages=[{group}]",)
    if family("training", trained) != family(group, recipe):
        # A recipe that converts whatever this run trains (${training.run.name}): a training
        # recipe of its folder (t5/, mt5/, bert/).
        folder = recipe.split("/")[0]
        trained = next(r for r in recipe_options("training") if r.startswith(f"{folder}/"))
    args = [f"stages=[{','.join((*UPSTREAM[group], group))}]", f"training={trained}"]
    if "conversion" in UPSTREAM[group]:
        args += [
            f"conversion={recipe_of_family('conversion', family(group, recipe))}",
            f"conversion.run.model_train_name={target.run.model_train_name}",
        ]
    return tuple(args)


def auto_family(group: str, recipe: str, root: Path) -> list[str]:
    """What an `auto` recipe's family is read from: a Hugging Face directory (its config.json's
    model_type); for a portable file not written yet, the family given."""
    if (group, recipe) == ("conversion", "hf_export"):
        return ["conversion.model_family=gpt"]
    if (group, recipe) != ("conversion", "hf_import"):
        return []
    folder = root / "hf" / "t5-small"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "t5"}')
    return [f"conversion.hf_model_dir={folder}"]


def overrides(group: str, recipe: str, cluster_type: str, root: Path) -> list[str]:
    # Kubernetes pods see only their volumes: the checkout and the test's folder.
    volumes = ",".join(
        f"{{name:{name},mount_path:'{path}',host_path:'{path}'}}"
        for name, path in (("code", REPO), ("scratch", root))
    )
    return [
        *([f"cluster.volumes=[{volumes}]"] if cluster_type == "k8s" else []),
        *upstream(group, recipe),
        f"{group}={recipe}",
        *FILLS.get((group, recipe), []),
        *auto_family(group, recipe, root),
        f"cluster_type={cluster_type}",
        f"data_dir={root / 'data'}",
        f"base_results_dir={root / 'results'}",
        *([] if cluster_type == "local" else [f"container={IMAGE}"]),
        "dry_run=true",
    ]


def several_nodes(cfg: DictConfig) -> list[str]:
    """The requested stages whose recipe asks for more than one node."""
    return [
        str(stage)
        for stage in cfg.stages
        if int(OmegaConf.select(cfg[stage], "trainer.num_nodes", default=1) or 1) > 1
    ]


@pytest.mark.parametrize(("group", "recipe", "cluster_type"), backend_cases(RUNNABLE))
def test_recipe_validates_and_renders(
    group: str, recipe: str, cluster_type: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if cluster_type not in BACKENDS:
        pytest.fail(f"cluster_type {cluster_type} has no backend")
    # The recipes are for any cluster: not checked against this machine's Slurm (the tests').
    without_slurm(monkeypatch)
    cfg = compose_config(overrides(group, recipe, cluster_type, tmp_path))
    if cluster_type == "local" and several_nodes(cfg):
        # One machine's processes: a recipe of several nodes (or the training run before the
        # stage) passes every other check, and is refused by the last, the backend's.
        with pytest.raises(ConfigError, match="runs on this machine") as refused:
            plan(cfg)
        assert refused.value.key == f"{several_nodes(cfg)[0]}.trainer.num_nodes"
        return
    backend, _resolved, planned = plan(cfg)
    jobs = [job for stage in planned for job in stage.jobs]
    assert jobs, "the stage rendered no job"
    for job in jobs:
        assert job.script, job.spec.name
        if job.script_path.suffix == ".sh":
            check = subprocess.run(["bash", "-n"], input=job.script, capture_output=True, text=True)
            assert check.returncode == 0, check.stderr
        else:
            documents = list(yaml.safe_load_all(job.script))
            assert documents and all(isinstance(doc, dict) for doc in documents)
    assert backend.name == cluster_type
