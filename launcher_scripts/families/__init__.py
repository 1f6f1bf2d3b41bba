"""Model families, one module each (gpt, t5, bert). Importing the package imports every module
in it, and each family module registers itself: a new family is one new module here (plus its
torch side under launcher_scripts/jobs/models and its recipes), with no list to edit."""

import importlib
import pkgutil

from launcher_scripts.families.base import (
    DEFAULT,
    FAMILIES,
    PROGRAMS,
    ModelFamily,
    family_mismatch,
    family_of,
    model_types,
    of_model_type,
    running,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "DEFAULT",
    "FAMILIES",
    "PROGRAMS",
    "ModelFamily",
    "family_mismatch",
    "family_of",
    "model_types",
    "of_model_type",
    "running",
]
