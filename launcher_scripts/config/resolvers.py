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


def is_installed_launcher(folder: str | Path) -> bool:
    """Whether `folder` holds the launcher as pip installs it (site-packages: the recipes inside
    the package), not a checkout (the recipes in conf/ at its top)."""
    return (Path(folder) / "launcher_scripts" / "conf" / "config.yaml").is_file()


def output_root(launcher_scripts_path: str) -> str:
    """Where `data_dir` and `base_results_dir` go by default: under `launcher_scripts_path`, as in
    a checkout, unless that is an installed launcher: never write into site-packages (shared,
    often read-only, emptied by the next upgrade); the current directory then."""
    if is_installed_launcher(launcher_scripts_path):
        return str(Path.cwd())
    return launcher_scripts_path


def path_name(path: str) -> str:
    """The last part of a path (a Hugging Face model directory's name names its results)."""
    return Path(str(path).rstrip("/")).name


RESOLVERS = {
    "multiply": multiply,
    "divide_ceil": divide_ceil,
    "divide_floor": divide_floor,
    "launcher_root": launcher_root,
    "output_root": output_root,
    "path_name": path_name,
}


def register_resolvers() -> None:
    for name, function in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, function)


register_resolvers()
