"""Checks of the whole configuration that do not belong to one stage, and resolution.

Everything here runs before anything is written or submitted.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from launcher_scripts.config.checks import require_choice, require_file, require_int
from launcher_scripts.errors import ConfigError

CLUSTER_TYPES = ("local", "bcm", "bcp", "k8s")
NUMA_MODES = ("all", "single", "single_unique", "unique_interleaved", "unique_contiguous")
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
        except OmegaConfBaseException as error:
            message = str(error).splitlines()[0]
            raise ConfigError(error.full_key or key, message, "Fix the value") from None
    return OmegaConf.create(resolved)


def check_globals(cfg: DictConfig) -> None:
    require_choice("cluster_type", cfg.cluster_type, CLUSTER_TYPES)
    for key in ("launcher_scripts_path", "data_dir", "base_results_dir"):
        if not cfg.get(key):
            raise ConfigError(key, "is not set", f"Set {key}=/absolute/path")
    numa = cfg.numa_mapping
    require_choice("numa_mapping.mode", numa.mode, NUMA_MODES)
    require_choice("numa_mapping.scope", numa.scope, ("node", "socket"))
    require_choice("numa_mapping.cores", numa.cores, ("all_logical", "single_logical"))
    require_int("numa_mapping.min_cores", numa.min_cores)
    if numa.max_cores is not None and require_int("numa_mapping.max_cores", numa.max_cores) < (
        numa.min_cores
    ):
        raise ConfigError(
            "numa_mapping.max_cores", "is below min_cores", "Raise max_cores or lower min_cores"
        )
    if cfg.wandb_api_key_file:
        require_file("wandb_api_key_file", cfg.wandb_api_key_file)
    for index, mount in enumerate(cfg.container_mounts or ()):
        if not str(mount or "").startswith("/"):
            raise ConfigError(
                f"container_mounts[{index}]",
                f"{mount!r} is not an absolute path",
                'Use "/src" or "/src:/dst"',
            )
