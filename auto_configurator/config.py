"""Compose `auto_configurator/conf/config.yaml` with command-line overrides (Hydra's compose API).

The launcher's composition helpers name an unknown recipe in one line; this module reuses them
for the `search_config` group and records which search config was chosen.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf, open_dict

from launcher_scripts.config import resolvers  # noqa: F401  (registers launcher_root etc.)
from launcher_scripts.config.compose import check_recipe_overrides
from launcher_scripts.errors import ConfigError, LauncherError

SEARCH_GROUP = "search_config"


def package_dir() -> Path:
    return Path(__file__).resolve().parent


def conf_dir() -> Path:
    return package_dir() / "conf"


def _register_resolvers() -> None:
    if not OmegaConf.has_resolver("auto_configurator_root"):
        OmegaConf.register_new_resolver("auto_configurator_root", lambda: str(package_dir()))


_register_resolvers()


def compose_config(overrides: Sequence[str]) -> DictConfig:
    """The composed configuration, unresolved, with `search_config_value` set to the chosen
    search config (e.g. 'gpt3/5b'). Raises ConfigError on any composition error."""
    root = conf_dir()
    check_recipe_overrides(overrides, root)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(root), version_base="1.3"):
            cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    except MissingConfigException as error:
        raise ConfigError("config", _first_line(error), "Check the search_config name") from error
    except HydraException as error:
        raise LauncherError(f"bad override: {_first_line(error)}") from error
    choice = cfg.hydra.runtime.choices.get(SEARCH_GROUP)
    with open_dict(cfg):
        del cfg["hydra"]
        cfg.search_config_value = choice
    return cfg


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return " ".join(lines[:2]) if lines else type(error).__name__
