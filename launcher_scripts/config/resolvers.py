"""OmegaConf resolvers the recipes use. Registered once, on import of this module."""

from __future__ import annotations

import math
from pathlib import Path

from omegaconf import OmegaConf


def multiply(a: float, b: float) -> float:
    return a * b


def divide_ceil(a: float, b: float) -> int:
    return math.ceil(a / b)


def divide_floor(a: float, b: float) -> int:
    return math.floor(a / b)


def launcher_root() -> str:
    """The directory holding the `launcher_scripts` package: the checkout, or site-packages.

    It goes on PYTHONPATH inside jobs and is mounted into containers, so job programs run from
    the same code the launcher rendered them with.
    """
    return str(Path(__file__).resolve().parents[2])


RESOLVERS = {
    "multiply": multiply,
    "divide_ceil": divide_ceil,
    "divide_floor": divide_floor,
    "launcher_root": launcher_root,
}


def register_resolvers() -> None:
    for name, function in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, function)


register_resolvers()
