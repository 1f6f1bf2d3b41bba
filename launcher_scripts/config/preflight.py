"""Checks of the whole configuration that do not belong to one stage, and resolution.

Everything here runs before anything is written or submitted.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Collection, Iterable
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (
    InterpolationToMissingValueError,
    MissingMandatoryValue,
    OmegaConfBaseException,
)

from launcher_scripts.config.checks import require_choice, require_file
from launcher_scripts.errors import ConfigError

GLOBAL_KEYS = (
    "stages",
    "cluster_type",
    "cluster",
    "launcher_scripts_path",
    "data_dir",
    "base_results_dir",
    "container",
    "container_mounts",
    "env_vars",
    "wandb_api_key_file",
    "nccl_topology",
    "numa_mapping",
    "plan",
    "dry_run",
)


def requested_stages(cfg: DictConfig, known: Iterable[str], groups: Iterable[str]) -> list[str]:
    stages = cfg.get("stages")
    if isinstance(stages, str):
        stages = [stages]
    if not isinstance(stages, ListConfig | list) or not stages:
        raise ConfigError("stages", "is empty", "Give stages=[data_preparation,...]")
    known, groups = list(known), set(groups)
    for stage in stages:
        if stage in known:
            continue
        if stage in groups:
            raise ConfigError(
                "stages",
                f"'{stage}' has recipes but no job program in this launcher version yet",
                f"Runnable stages: {', '.join(known)}",
            )
        raise ConfigError("stages", f"'{stage}' is not a stage", f"Stages: {', '.join(known)}")
    duplicates = sorted({s for s in stages if list(stages).count(s) > 1})
    if duplicates:
        raise ConfigError("stages", f"lists {', '.join(duplicates)} twice", "List each stage once")
    return [str(s) for s in stages]


def resolve(cfg: DictConfig, stages: list[str]) -> DictConfig:
    """The global keys and the requested stages with every interpolation resolved.

    Recipes of stages not requested may leave values missing (`???`); they are left out.
    """
    resolved: dict[str, Any] = {}
    for key in (*GLOBAL_KEYS, *stages):
        if key not in cfg:
            continue
        try:
            node = cfg[key]
            if isinstance(node, DictConfig | ListConfig):
                resolved[key] = OmegaConf.to_container(node, resolve=True, throw_on_missing=True)
            else:
                resolved[key] = node
        except MissingMandatoryValue as error:
            full_key = error.full_key or key
            raise ConfigError(
                full_key, "has no value (???)", f"Set it on the command line: {full_key}=..."
            ) from None
        except InterpolationToMissingValueError as error:
            # Name the key left unset, not the one whose interpolation reads it.
            marker = "Missing mandatory value: "
            first = str(error).splitlines()[0]
            missing = first.split(marker, 1)[1].strip() if marker in first else error.full_key
            raise ConfigError(
                missing or key,
                f"has no value (???), and {error.full_key} reads it",
                f"Set it on the command line: {missing}=...",
            ) from None
        except OmegaConfBaseException as error:
            message = str(error).splitlines()[0]
            raise ConfigError(error.full_key or key, message, "Fix the value") from None
    return OmegaConf.create(escape_interpolations(resolved))


def escape_interpolations(value: Any) -> Any:
    """Resolved values with OmegaConf's interpolation syntax escaped, so a `${` that was text in
    the configuration (written `\\${`) stays text rather than becoming an interpolation again
    when the resolved values are made a config once more."""
    if isinstance(value, dict):
        return {key: escape_interpolations(item) for key, item in value.items()}
    if isinstance(value, list):
        return [escape_interpolations(item) for item in value]
    if isinstance(value, str):
        # Backslashes just before an escaped `${` escape themselves in OmegaConf's grammar.
        return re.sub(r"(\\*)\$\{", lambda match: match[1] * 2 + "\\${", value)
    return value


def check_globals(cfg: DictConfig, cluster_types: Collection[str]) -> None:
    """The keys every run reads. `cluster_types`: the backends' names
    (launcher_scripts.clusters.BACKENDS), which this layer cannot import. numa_mapping has its
    own check, recipes.numa.check_section: the recipe layer owns its choices, and config is
    below it."""
    require_choice("cluster_type", cfg.cluster_type, cluster_types)
    for key in ("launcher_scripts_path", "data_dir", "base_results_dir"):
        if not cfg.get(key):
            raise ConfigError(key, "is not set", f"Set {key}=/absolute/path")
    if ":" in str(cfg.launcher_scripts_path):
        raise ConfigError(
            "launcher_scripts_path",
            f"{cfg.launcher_scripts_path!r} holds a colon, which splits PYTHONPATH, where jobs "
            "find the code",
            "Use a path without colons (a symbolic link to it, say)",
        )
    if cfg.wandb_api_key_file:
        require_file("wandb_api_key_file", cfg.wandb_api_key_file, secret=True)
    for index, mount in enumerate(cfg.container_mounts or ()):
        if not str(mount or "").startswith("/"):
            raise ConfigError(
                f"container_mounts[{index}]",
                f"{mount!r} is not an absolute path",
                'Use "/src" or "/src:/dst"',
            )


def check_wandb(cfg: DictConfig, stages: Iterable[str], jobs_here: bool) -> None:
    """A stage asking for W&B logging needs wandb where its jobs run. `jobs_here`: they run in
    this Python environment, so it is checked here; a container image is not this environment,
    and the job checks it at its start."""
    if not jobs_here or importlib.util.find_spec("wandb") is not None:
        return
    for stage in stages:
        exp_manager = cfg[stage].get("exp_manager") if stage in cfg else None
        if isinstance(exp_manager, DictConfig) and exp_manager.get("create_wandb_logger"):
            raise ConfigError(
                f"{stage}.exp_manager.create_wandb_logger",
                "is true but wandb is not installed",
                'Install it (pip install "llm-launcher[wandb]") or set it to False',
            )
