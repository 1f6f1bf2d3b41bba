"""OmegaConf's YAML reading, on libyaml.

Hydra reads every recipe with `OmegaConf.load`, which parses with PyYAML's pure-Python loader:
most of the time a launch spends composing its configuration (0.4 s of a 0.6 s compose here,
paid by every `main.py` run, every dry run and every test that composes). The loader made here
is OmegaConf's own class, with its duplicate-key check and its rules for numbers and dates, and
libyaml's parser in front of it, so a file reads as it did; only the parsing is in C.
`install()` makes OmegaConf (and so Hydra) use it. Where PyYAML was built without libyaml, or
OmegaConf no longer has the hook, nothing changes.
"""

from __future__ import annotations

import functools
from typing import Any

import yaml
from omegaconf import _utils as omegaconf_utils

_OMEGACONF_LOADER = getattr(omegaconf_utils, "get_yaml_loader", None)


@functools.cache
def loader() -> Any:
    """OmegaConf's loader class, parsing with libyaml where PyYAML has it."""
    base = _OMEGACONF_LOADER() if _OMEGACONF_LOADER is not None else yaml.SafeLoader
    try:
        from yaml._yaml import CParser
    except ImportError:
        return base

    class LibyamlOmegaConfLoader(CParser, base):  # type: ignore[misc, valid-type]
        def __init__(self, stream: Any) -> None:
            CParser.__init__(self, stream)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)

    return LibyamlOmegaConfLoader


def install() -> None:
    """Have OmegaConf.load (Hydra's reader) use `loader()`; idempotent."""
    if _OMEGACONF_LOADER is not None:
        omegaconf_utils.get_yaml_loader = loader
