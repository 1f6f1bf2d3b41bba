"""Hydra's loading of recipe files, kept between compositions in one process.

Every composition loads `conf/config.yaml`, the cluster file and all eleven default stage
recipes, and builds an OmegaConf tree of each: about half of a compose's time. A process that
composes many times (the AutoConfigurator plans every candidate of its search; the test suite)
built the same trees again and again. Here each file's loaded result is kept, keyed by its path,
modification time and size, so an edited recipe is read afresh.

A kept tree must never change. Hydra merges every loaded tree into the composition without
copying its nodes, and then applies the overrides to them: each composition gets a fresh copy.
The copy is made from the tree's pickle, kept with it: unpickling is about six times faster than
the deep copy Hydra makes when it places a recipe under its package (the largest single cost of
a compose). Where Hydra's internals are not 1.3's, nothing is installed.
"""

from __future__ import annotations

import copy
import os
import pickle
from typing import Any

_kept: dict[tuple, Any] = {}  # (config path, file, mtime, size) -> Hydra's ConfigResult
# id of a kept result's config (it lives as long as _kept) -> that config's pickle
_kept_trees: dict[int, bytes] = {}


def install() -> None:
    try:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra._internal.config_repository import ConfigRepository
        from hydra.core.object_type import ObjectType
        from hydra.plugins.config_source import ConfigSource
        from omegaconf import OmegaConf, flag_override
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
            _kept_trees[id(loaded.config)] = pickle.dumps(loaded.config)
        kept = _kept[key]
        result = copy.copy(kept)
        # Hydra rewrites these per composition (the package a default is placed at).
        result.header = dict(kept.header)
        result.defaults_list = copy.deepcopy(kept.defaults_list)
        return result

    def embed_result_config(ret: Any, package_override: str | None) -> Any:
        kept = _kept_trees.get(id(ret.config))
        if kept is None:
            return embed(ret, package_override)
        # Hydra's own embedding, on a fresh copy that needs no second one.
        tree = pickle.loads(kept)
        package = ret.header["package"] if package_override is None else package_override
        if package:
            placed = OmegaConf.create()
            with flag_override(placed, "no_deepcopy_set_nodes", True):
                OmegaConf.update(placed, package, tree, merge=False)
            tree = placed
        embedded = copy.copy(ret)
        embedded.config = tree
        return embedded

    load_config.kept_between_compositions = True  # type: ignore[attr-defined]
    load_config.original = load  # type: ignore[attr-defined]
    embed_result_config.original = embed  # type: ignore[attr-defined]
    ConfigRepository.load_config = load_config  # type: ignore[method-assign]
    ConfigLoaderImpl._embed_result_config = staticmethod(embed_result_config)  # type: ignore[method-assign]
