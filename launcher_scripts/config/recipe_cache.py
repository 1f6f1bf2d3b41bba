"""Hydra's loading of recipe files, kept between compositions in one process.

Every composition loads `conf/config.yaml`, the cluster file and all eleven default stage
recipes, and builds an OmegaConf tree of each: about half of a compose's time. A process that
composes many times (the AutoConfigurator plans every candidate of its search; the test suite)
built the same trees again and again. Here each file's loaded result is kept, keyed by its path,
modification time and size, so an edited recipe is read afresh.

A kept tree must never change. Hydra embeds a group's recipe under its package with a deep copy
before merging it, so that tree is safe to share; a config merged at the root (the primary config,
or one placed at `_global_`) is merged without a copy and then changed by the overrides, so that
one is handed out as a deep copy. Where Hydra's internals are not 1.3's, nothing is installed.
"""

from __future__ import annotations

import copy
import os
from typing import Any

_kept: dict[tuple, Any] = {}  # (config path, file, mtime, size) -> Hydra's ConfigResult
_kept_trees: set[int] = set()  # ids of the kept results' configs (they live as long as _kept)


def install() -> None:
    try:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra._internal.config_repository import ConfigRepository
        from hydra.core.object_type import ObjectType
        from hydra.plugins.config_source import ConfigSource
    except ImportError:
        return
    load, embed = ConfigRepository.load_config, ConfigLoaderImpl._embed_result_config
    if getattr(load, "kept_between_compositions", False):
        return
    if not (hasattr(ConfigRepository, "_find_object_source") and isinstance(embed, type(install))):
        return

    def key_of(repository: Any, config_path: str) -> tuple | None:
        source = repository._find_object_source(
            config_path=config_path, object_type=ObjectType.CONFIG
        )
        if source is None or source.scheme() != "file":
            return None
        name = ConfigSource._normalize_file_name(filename=config_path)
        path = os.path.realpath(os.path.join(source.path, name))
        try:
            status = os.stat(path)
        except OSError:
            return None
        return (config_path, path, status.st_mtime_ns, status.st_size)

    def load_config(self: Any, config_path: str) -> Any:
        key = key_of(self, config_path)
        if key is None:
            return load(self, config_path)
        if key not in _kept:
            loaded = load(self, config_path)
            if loaded is None:
                return None
            _kept[key] = loaded
            _kept_trees.add(id(loaded.config))
        kept = _kept[key]
        result = copy.copy(kept)
        # Hydra rewrites these per composition (the package a default is placed at).
        result.header = dict(kept.header)
        result.defaults_list = copy.deepcopy(kept.defaults_list)
        return result

    def embed_result_config(ret: Any, package_override: str | None) -> Any:
        embedded = embed(ret, package_override)
        if embedded.config is ret.config and id(ret.config) in _kept_trees:
            embedded = copy.copy(embedded)
            embedded.config = copy.deepcopy(ret.config)
        return embedded

    load_config.kept_between_compositions = True  # type: ignore[attr-defined]
    load_config.original = load  # type: ignore[attr-defined]
    embed_result_config.original = embed  # type: ignore[attr-defined]
    ConfigRepository.load_config = load_config  # type: ignore[method-assign]
    ConfigLoaderImpl._embed_result_config = staticmethod(embed_result_config)  # type: ignore[method-assign]
