"""The package list, found rather than written out, so a new package cannot be left out of the
wheel. Everything else is in pyproject.toml; pyproject alone cannot both find packages and add
one from another folder: conf/, installed as launcher_scripts.conf."""

from setuptools import find_namespace_packages, setup

# The top-level folders that ship, each under the package name it installs as; tests/ and
# bench/ are for developers.
SHIPPED = {
    "launcher_scripts": "launcher_scripts",
    "auto_configurator": "auto_configurator",
    "csp_tools": "csp_tools",
    "conf": "launcher_scripts.conf",  # mapped in pyproject.toml's package-dir
}


def packages_in(folder: str, name: str) -> list[str]:
    """`name` and every folder below it as a package: namespace packages, so that folders of
    data only (eval_tasks/, the recipe groups) ship their files too."""
    found = find_namespace_packages(folder, exclude=["*__pycache__*"])
    return [name, *(f"{name}.{package}" for package in found)]


setup(packages=[p for folder, name in SHIPPED.items() for p in packages_in(folder, name)])
