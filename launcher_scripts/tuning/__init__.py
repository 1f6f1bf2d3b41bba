"""PEFT methods as registered plug-ins (method.py); importing the package registers every
method module in it."""

from __future__ import annotations

import importlib
import pkgutil

from launcher_scripts.tuning.method import (
    METHODS,
    PeftMethod,
    PeftSettings,
    legacy_method,
    merging_titles,
    method_named,
)

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "method":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "METHODS",
    "PeftMethod",
    "PeftSettings",
    "legacy_method",
    "merging_titles",
    "method_named",
]
