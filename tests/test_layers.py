"""The package's layers, read from the source: what each layer may import, and that no module
outside the family registry tells model families apart by name.

Layers, top to bottom: entry points -> pipeline/ops -> stages and cluster backends -> the
torch-free recipe, format, family and cost-model packages -> shared utilities. Job programs
(launcher_scripts/jobs) sit beside the stages: they import the torch-free layer and libraries,
never the stages, the backends, the pipeline or the AutoConfigurator.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher_scripts import families

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "launcher_scripts"
TORCH_FREE = ("recipes", "formats", "costmodel", "families", "config")
LAUNCHER_SIDE = ("stages", "clusters", "config", "recipes", "formats", "costmodel", "families")
# What neither the torch-free layers nor the job programs may import.
ABOVE_THE_LAYERS = (
    "launcher_scripts.stages",
    "launcher_scripts.clusters",
    "launcher_scripts.pipeline",
    "launcher_scripts.ops",
    "launcher_scripts.main",
    "auto_configurator",
)
LIBRARIES_WITH_TORCH = ("torch", "megatron", "transformers", "transformer_engine", "lm_eval")


def sources(*folders: Path) -> Iterator[Path]:
    for folder in folders:
        yield from sorted(folder.rglob("*.py")) if folder.is_dir() else [folder]


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """Every module an import statement names, at any depth (imports inside functions too)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.lineno, node.module
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def module_level_imports(path: Path) -> Iterator[tuple[int, str]]:
    """The imports a module runs when it is imported (not those in functions, nor the
    type checker's)."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.lineno, node.module


def violations(
    folders: tuple[Path, ...], forbidden: tuple[str, ...], imports: Any = imported_modules
) -> list[str]:
    found = []
    for path in sources(*folders):
        for line, module in imports(path):
            if any(module == f or module.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return sorted(set(found))


def runtime_modules() -> set[Path]:
    """The families' torch-side modules, which only job programs import."""
    return {
        ROOT.joinpath(*family.runtime.split(".")).with_suffix(".py")
        for family in families.FAMILIES.values()
        if family.runtime
    }


def test_the_launcher_side_imports_no_job_program() -> None:
    folders = (*(PACKAGE / name for name in LAUNCHER_SIDE), *PACKAGE.glob("*.py"))
    assert violations(folders, ("launcher_scripts.jobs",)) == []


def test_the_recipe_format_family_and_cost_layers_import_no_torch() -> None:
    """Preflight and dry runs load them: importing them loads no torch (a function that
    handles tensors imports it when called)."""
    folders = tuple(PACKAGE / name for name in TORCH_FREE)
    runtime = runtime_modules()
    found = [
        v
        for v in violations(folders, LIBRARIES_WITH_TORCH, module_level_imports)
        if ROOT / v.split(":")[0] not in runtime
    ]
    assert found == []


def test_the_torch_free_layers_import_nothing_above_them() -> None:
    assert violations(tuple(PACKAGE / name for name in TORCH_FREE), ABOVE_THE_LAYERS) == []


def test_job_programs_import_no_stage_backend_pipeline_or_autoconfigurator() -> None:
    assert violations((PACKAGE / "jobs",), ABOVE_THE_LAYERS) == []


def family_names() -> set[str]:
    return {*families.FAMILIES, *families.model_types()}


def name_literals(path: Path) -> list[str]:
    names = family_names()
    return [
        f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}"
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
    ]


def test_no_module_outside_the_registry_names_a_model_family() -> None:
    """A family is asked (`family_of(cfg, stage).runs("export")`), never compared by name: a
    new family is one module plus its recipes."""
    found = [
        hit
        for path in sources(PACKAGE, ROOT / "auto_configurator", ROOT / "main.py")
        if PACKAGE / "families" not in path.parents
        for hit in name_literals(path)
    ]
    assert found == []


@pytest.mark.parametrize("module", ["gpt", "t5", "bert"])
def test_the_name_scan_sees_each_familys_own_name(module: str) -> None:
    """The scan above would see a comparison: it finds each family's name where it belongs."""
    assert name_literals(PACKAGE / "families" / f"{module}.py")


def test_the_hugging_face_import_job_loads_no_megatron_core() -> None:
    """Importing a checkpoint maps tensors from file to file: the job and each family's
    importer run where megatron-core is not installed (it is blocked here)."""
    importers = [f.hf_importer for f in families.FAMILIES.values() if f.hf_importer]
    assert importers, "no family imports from Hugging Face"
    program = "\n".join(
        [
            "import importlib, sys",
            "sys.modules['megatron'] = None  # any import of it raises ImportError",
            "for name in sys.argv[1:]:",
            "    importlib.import_module(name)",
        ]
    )
    modules = [
        "launcher_scripts.jobs.conversion.hf_import",
        "launcher_scripts.formats.portable",
        "launcher_scripts.formats.safetensors_stream",
        *importers,
    ]
    result = subprocess.run(
        [sys.executable, "-c", program, *modules], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]
