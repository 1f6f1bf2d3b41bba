"""The launcher's training recipes as the AutoConfigurator reads and writes them.

Recipes are composed with the launcher's own composition (launcher_scripts.config.compose), so a
base config starts from a shipped recipe with every key the training stage reads, and a written
recipe file is loaded by the launcher exactly as `python3 main.py training=/abs/file.yaml` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from launcher_scripts import families
from launcher_scripts.config.compose import compose_config, is_recipe_file, recipe_options
from launcher_scripts.config.preflight import resolve
from launcher_scripts.errors import ConfigError
from launcher_scripts.files import write_atomic

STAGE = "training"


def launcher_overrides(cfg: DictConfig) -> list[str]:
    """What the launcher takes from the AutoConfigurator's settings."""
    # Absolute: the launcher runs in its own folder.
    return [f"data_dir={Path(str(cfg.data_dir)).absolute()}", f"cluster_type={cfg.cluster_type}"]


def compose_recipe(recipe: str, overrides: Sequence[str], setting_key: str) -> DictConfig:
    """The launcher's root configuration with `training=<recipe>` (a conf/training name or an
    absolute .yaml path) and `overrides`; unresolved."""
    if not is_recipe_file(recipe) and recipe not in recipe_options(STAGE):
        available = ", ".join(recipe_options(STAGE))
        raise ConfigError(
            setting_key, f"{recipe!r} is not a training recipe", f"Use one of: {available}"
        )
    return compose_config([f"{STAGE}={recipe}", *overrides])


def resolved_stage(root: DictConfig) -> DictConfig:
    """The root's global keys and the training stage, every interpolation resolved."""
    return resolve(root, [STAGE])


def check_family(recipe: DictConfig, model_type: str, setting_key: str) -> None:
    """The recipe is of the family the search config's model type (its folder) belongs to."""
    wanted = families.of_model_type(model_type)
    found = families.family_of(recipe, STAGE)
    if found is not wanted:
        raise ConfigError(
            setting_key,
            f"is a {found.name} recipe but this search config is for {model_type} "
            f"(model_family {wanted.name})",
            f"Name a conf/training/{model_type}/ recipe",
        )


def write_recipe(path: Path, recipe: DictConfig, header: str) -> None:
    """The training section as a recipe file; interpolations (${data_dir}...) are kept so the
    launcher resolves them against its own settings when it runs the file."""
    body = OmegaConf.to_yaml(recipe, resolve=False)
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    write_atomic(path, comment + body)


def set_keys(recipe: DictConfig, values: dict[str, Any], add: bool = False) -> None:
    """Set dotted keys (e.g. 'model.num_layers') that the recipe has (or, with `add`, may
    lack)."""
    for key, value in values.items():
        if not add and not _has(recipe, key):
            raise ConfigError(
                f"{STAGE}.{key}",
                "is not in the base recipe",
                "Start from a recipe with the launcher's training keys",
            )
        with open_dict(recipe):
            OmegaConf.update(recipe, key, value, merge=False)


def _has(recipe: DictConfig, key: str) -> bool:
    parent_key, _, leaf = key.rpartition(".")
    parent = recipe
    for part in parent_key.split(".") if parent_key else ():
        parent = parent.get(part) if isinstance(parent, DictConfig) else None
    return isinstance(parent, DictConfig) and leaf in parent
