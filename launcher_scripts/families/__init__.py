"""Model families, one module each; importing the package registers them all."""

from launcher_scripts.families import bert, gpt, t5
from launcher_scripts.families.base import (
    DEFAULT,
    FAMILIES,
    PROGRAMS,
    ModelFamily,
    family_of,
    model_types,
    of_model_type,
    running,
)

__all__ = [
    "DEFAULT",
    "FAMILIES",
    "PROGRAMS",
    "ModelFamily",
    "bert",
    "family_of",
    "gpt",
    "model_types",
    "of_model_type",
    "running",
    "t5",
]
