"""Composition of the recipes and the package's resolvers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launcher_scripts.config import resolvers
from launcher_scripts.config.compose import (
    compose_config,
    conf_dir,
    config_groups,
    recipe_options,
)
from launcher_scripts.config.preflight import resolve
from launcher_scripts.errors import ConfigError, LauncherError

STAGE_GROUPS = [
    "data_preparation",
    "training",
    "conversion",
    "fine_tuning",
    "peft",
    "prompt_learning",
    "adapter_learning",
    "ia3_learning",
    "evaluation",
    "export",
]


def test_a_run_composes_the_groups_it_runs_names_or_reads() -> None:
    """Only those: the others' recipes are not built (most of a launch's composing time)."""
    alone = compose_config(["stages=[training]"])
    assert [g for g in STAGE_GROUPS if g in alone] == ["training"]
    # The conversion recipe reads ${training.run.name}; a key given names its group.
    read = compose_config(["stages=[conversion]", "peft.trainer.devices=2"])
    assert {g for g in STAGE_GROUPS if g in read} == {"conversion", "training", "peft"}
    # Stages given in a form this does not read: every group, as before.
    assert all(g in compose_config(["stages=training"]) for g in STAGE_GROUPS)


def test_defaults_choose_one_recipe_per_group() -> None:
    cfg = compose_config([])
    for group in [*cfg.stages, "cluster"]:
        assert group in cfg, group
    for group in STAGE_GROUPS:  # each group's recipe, where a run has that stage
        assert group in compose_config([f"stages=[{group}]"]), group
    assert list(cfg.stages) == [
        "data_preparation",
        "training",
        "conversion",
        "evaluation",
        "export",
    ]
    assert cfg.cluster_type == "local"
    assert cfg.dry_run is False
    assert set(cfg.numa_mapping) == {
        "enable",
        "mode",
        "scope",
        "cores",
        "balanced",
        "min_cores",
        "max_cores",
    }


def test_every_stage_group_has_a_recipe_directory() -> None:
    assert set(STAGE_GROUPS) | {"cluster"} <= set(config_groups())
    for group in STAGE_GROUPS:
        assert recipe_options(group), group


def test_launcher_scripts_path_defaults_to_the_checkout() -> None:
    resolved = resolve(compose_config([]), ["data_preparation"])
    assert resolved.launcher_scripts_path == str(conf_dir().parent)
    assert resolved.data_dir == f"{resolved.launcher_scripts_path}/data"


def test_overrides_reach_the_stage_config() -> None:
    cfg = compose_config(
        ["data_preparation.raw_dataset_files=[/d/a.jsonl,/d/b.jsonl.gz]", "data_dir=/d"]
    )
    resolved = resolve(cfg, ["data_preparation"])
    assert list(resolved.data_preparation.raw_dataset_files) == ["/d/a.jsonl", "/d/b.jsonl.gz"]
    assert resolved.data_preparation.preprocessed_dir == "/d/custom_dataset/preprocessed"


def test_resolvers_are_registered_by_the_package() -> None:
    cfg = OmegaConf.create(
        {"a": "${multiply:3,4}", "b": "${divide_ceil:7,2}", "c": "${divide_floor:7,2}"}
    )
    assert (cfg.a, cfg.b, cfg.c) == (12, 4, 3)
    assert resolvers.divide_ceil(8, 4) == 2
    assert resolvers.divide_floor(-1, 2) == -1


def test_unknown_recipe_lists_the_available_ones() -> None:
    with pytest.raises(ConfigError) as error:
        compose_config(["training=gpt3/no_such_size"])
    assert "training=gpt3/no_such_size" in str(error.value)
    assert "gpt3/126m" in str(error.value) and "gpt3/tiny" in str(error.value)


def test_unknown_key_is_an_error() -> None:
    with pytest.raises(LauncherError, match="no_such_key"):
        compose_config(["no_such_key=1"])


def test_missing_value_names_the_key() -> None:
    cfg = compose_config(["data_preparation.text_key=???"])
    with pytest.raises(ConfigError, match=r"data_preparation.text_key: has no value"):
        resolve(cfg, ["data_preparation"])


@pytest.mark.parametrize("cluster_type", ["local", "bcm", "bcp"])
def test_cluster_type_picks_its_cluster_file(cluster_type: str) -> None:
    expected = OmegaConf.load(conf_dir() / "cluster" / f"{cluster_type}.yaml")
    assert compose_config([f"cluster_type={cluster_type}"]).cluster == expected


def test_a_sites_own_cluster_file_wins_over_the_cluster_type(tmp_path) -> None:
    site = OmegaConf.load(conf_dir() / "cluster" / "bcm.yaml")
    site.partition, site.account = "gpu", "llm"
    path = tmp_path / "site_slurm.yaml"
    OmegaConf.save(site, path)
    cfg = compose_config(["cluster_type=bcm", f"cluster={path}"])
    assert cfg.cluster == site
    assert cfg.cluster_type == "bcm"


def test_the_default_cluster_file_matches_the_default_cluster_type() -> None:
    cfg = compose_config([])
    assert cfg.cluster == OmegaConf.load(conf_dir() / "cluster" / f"{cfg.cluster_type}.yaml")


def test_a_recipe_file_that_is_not_yaml_is_one_line_naming_its_line(tmp_path: Path) -> None:
    """A flow list holding an interpolation (PyYAML reads `{` as a mapping) is the usual way
    to break a recipe: the file, line and column, what PyYAML found, and the fix."""
    from launcher_scripts.config.compose import compose_in, conf_dir

    root = tmp_path / "conf"
    shutil.copytree(conf_dir(), root)
    recipe = root / "training" / "gpt3" / "tiny.yaml"
    lines = recipe.read_text().splitlines()
    recipe.write_text("\n".join([*lines, "broken: [${x}/a.jsonl]", ""]))
    with pytest.raises(LauncherError) as raised:
        compose_in(root, "config", [], "")
    message = str(raised.value)
    assert message.startswith(f"{recipe}:{len(lines) + 1}:"), message
    assert "not valid YAML" in message and "quote a value" in message
    assert "\n" not in message
