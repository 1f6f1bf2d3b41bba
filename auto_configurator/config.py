"""Compose `auto_configurator/conf/config.yaml` with command-line overrides (Hydra's compose API).

The launcher's composition helpers name an unknown recipe in one line; this module reuses them
for the `search_config` group and records which search config was chosen.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from launcher_scripts.config import resolvers  # noqa: F401  (registers launcher_root etc.)
from launcher_scripts.config.compose import check_recipe_overrides, compose_in
from launcher_scripts.errors import ConfigError

SEARCH_GROUP = "search_config"


def package_dir() -> Path:
    return Path(__file__).resolve().parent


def conf_dir() -> Path:
    return package_dir() / "conf"


def _register_resolvers() -> None:
    if not OmegaConf.has_resolver("auto_configurator_root"):
        OmegaConf.register_new_resolver("auto_configurator_root", lambda: str(package_dir()))


_register_resolvers()


# The NeMo AutoConfigurator's root keys that have no use here, with why and what to use.
NEMO_ONLY = {
    "fastertransformer_path": (
        "is the NeMo AutoConfigurator's path to FasterTransformer, which this one does not use: "
        "the inference search serves the converted model with the launcher's own engine",
        "Remove it (search_config.inference_settings sets the inference search)",
    ),
}


def check_root_keys(overrides: Sequence[str], root: Path) -> None:
    """A root key the AutoConfigurator has no use for (NeMo's, or a misspelt one added with
    `+`) is refused in one line, not composed and ignored."""
    known = set(OmegaConf.load(root / "config.yaml")) | {SEARCH_GROUP}
    for override in overrides:
        key = override.partition("=")[0].lstrip("+~").split(".")[0]
        if key in NEMO_ONLY:
            raise ConfigError(key, *NEMO_ONLY[key])
        if override.startswith("+") and key not in known:
            raise ConfigError(
                key,
                "is not a key of the AutoConfigurator (auto_configurator/conf/config.yaml)",
                f"Remove it; the keys are: {', '.join(sorted(known - {'defaults'}))}",
            )


def compose_config(overrides: Sequence[str]) -> DictConfig:
    """The composed configuration, unresolved, with `search_config_value` set to the chosen
    search config (e.g. 'gpt3/5b'). Raises ConfigError on any composition error."""
    root = conf_dir()
    check_root_keys(overrides, root)
    check_recipe_overrides(overrides, root)
    cfg = compose_in(
        root, "config", overrides, "Check the search_config name", return_hydra_config=True
    )
    choice = cfg.hydra.runtime.choices.get(SEARCH_GROUP)
    with open_dict(cfg):
        del cfg["hydra"]
        cfg.search_config_value = choice
    return cfg
