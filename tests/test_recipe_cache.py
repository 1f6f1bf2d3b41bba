"""Recipe files kept between compositions (`launcher_scripts.config.recipe_cache`) compose exactly
what Hydra composes without them, whatever order the compositions come in, and an edited recipe
is read afresh."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.config_repository import ConfigRepository
from omegaconf import OmegaConf

from launcher_scripts.config import recipe_cache
from launcher_scripts.config.compose import compose_config, compose_in, conf_dir

# Overrides that change the primary config, the cluster file and stage recipes, each followed
# later by a composition that must not see it.
SEQUENCE = [
    [],
    ["stages=[training]", "dry_run=true", "env_vars.NCCL_TOPO_FILE=/x"],
    ["cluster_type=bcm", "cluster.partition=p1", "training=gpt3/5b"],
    ["training.model.num_layers=3", "training.run.name=changed"],
    ["stages=[peft]", "peft=t5/squad", "peft.model.peft.peft_scheme=lora"],
    [],
    ["cluster_type=k8s", "fine_tuning=mt5/xquad", "numa_mapping.enable=false"],
    ["cluster_type=bcm"],
    ["training=gpt3/5b"],
    ["peft=t5/squad"],
    [],
]


def compositions() -> list[str]:
    return [OmegaConf.to_yaml(compose_config(overrides)) for overrides in SEQUENCE]


def test_the_cache_is_installed() -> None:
    assert getattr(ConfigRepository.load_config, "kept_between_compositions", False)


def test_compositions_equal_hydras_own_in_any_order(monkeypatch: pytest.MonkeyPatch) -> None:
    cached = compositions()
    again = compositions()  # every file now comes from the cache
    uncached_load = ConfigRepository.load_config.original
    uncached_embed = ConfigLoaderImpl._embed_result_config.original
    monkeypatch.setattr(ConfigRepository, "load_config", uncached_load)
    monkeypatch.setattr(ConfigLoaderImpl, "_embed_result_config", staticmethod(uncached_embed))
    assert cached == compositions()
    assert again == cached
    assert "changed" not in cached[-1] and "/x" not in cached[-1]


def test_an_edited_recipe_is_read_afresh(tmp_path: Path) -> None:
    root = tmp_path / "conf"
    shutil.copytree(conf_dir(), root)
    recipe = root / "training" / "gpt3" / "tiny.yaml"
    before = compose_in(root, "config", [], "")
    layers = before.training.model.num_layers
    kept = len(recipe_cache._kept)
    assert compose_in(root, "config", [], "") == before
    assert len(recipe_cache._kept) == kept, "a second composition loaded its files again"
    recipe.write_text(
        recipe.read_text().replace(f"num_layers: {layers}", f"num_layers: {layers + 1}", 1)
    )
    status = recipe.stat()
    os.utime(recipe, ns=(status.st_atime_ns, status.st_mtime_ns + 1_000_000_000))
    assert compose_in(root, "config", [], "").training.model.num_layers == layers + 1
