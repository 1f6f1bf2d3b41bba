"""The package's layers, read from the source: no import runs back up a layer or sideways
within one, the packages import each other in no circle, and no module outside the family
registry tells model families apart by name.

A package is a first-level folder or module of launcher_scripts (stages, pipeline, ...), the
package's own __init__, auto_configurator, csp_tools, or main.py. The layers, top to bottom;
a package imports only packages of the layers below its own:

  entry points            main.py, launcher_scripts/__main__.py
  the command line        launcher_scripts/main.py: a launch's overrides, and the command
                          words, each run by a module (the tools are job programs run here)
  commands, programs      serving.py (the `serve` command: runs the server program here or
                          submits it to Slurm), auto_configurator/, csp_tools/
  pipeline and ops        pipeline.py, ops.py (status, logs, cancel)
  the run manifest        manifest.py
  stages, backends, jobs  stages/, clusters/ and the job programs (jobs/) side by side: none
                          imports another (the stages name job programs in the commands
                          they render; naming is not importing)
  the torch-free layer, in this order:
    families/             the registry: a family asks the recipe checks and the cost model,
                          and registers its tensor-shape table with formats/
    costmodel/            reads the recipe views and the files
    recipes/              typed views of the recipes; use config/'s checks, formats' readers
    tuning/, curation/    side by side: the PEFT method registry (each method's settings and
                          checks); data curation's steps, sources and recipe view
    config/, formats/     side by side: composition and checks; the files
  shared utilities        errors.py, files.py, ports.py, jobspec.py, sample_data/ and the
                          package's __init__

So the job programs import the torch-free layer, the utilities and libraries, never stages,
clusters, pipeline, ops, manifest, serving, main or the AutoConfigurator; and of the launcher,
only the command line (main.py's tools) and the `serve` command import a job program, to run
it in this process.

Imports by string count as imports: `importlib.import_module("launcher_scripts.x")` and
`__import__("...")` with a literal name are read like an import statement. A computed name
(`import_module(TOOLS[word])`) is declared in DYNAMIC_IMPORTS with the modules it can take,
which count as that file's imports; an undeclared one fails. A string that names a module
without importing it is data: the stages' job commands, and the families' `runtime` and
`hf_importer`, which name each family's torch side for the job programs that import it
(declared there, jobs importing jobs).
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from launcher_scripts import families, tuning

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "launcher_scripts"
SOURCES = (PACKAGE, ROOT / "auto_configurator", ROOT / "csp_tools", ROOT / "main.py")
LAYERS: tuple[tuple[str, ...], ...] = (
    ("main", "launcher_scripts.__main__"),
    ("launcher_scripts.main",),
    ("launcher_scripts.serving", "auto_configurator", "csp_tools"),
    ("launcher_scripts.pipeline", "launcher_scripts.ops"),
    ("launcher_scripts.manifest",),
    ("launcher_scripts.stages", "launcher_scripts.clusters", "launcher_scripts.jobs"),
    ("launcher_scripts.families",),
    ("launcher_scripts.costmodel",),
    ("launcher_scripts.recipes",),
    ("launcher_scripts.tuning", "launcher_scripts.curation"),
    ("launcher_scripts.config", "launcher_scripts.formats"),
    (
        "launcher_scripts",
        "launcher_scripts.errors",
        "launcher_scripts.files",
        "launcher_scripts.ports",
        "launcher_scripts.jobspec",
        "launcher_scripts.sample_data",
    ),
)
LAYER_OF = {package: depth for depth, layer in enumerate(LAYERS) for package in layer}
TORCH_FREE = ("recipes", "formats", "costmodel", "families", "config", "tuning")
LAUNCHER_SIDE = (
    "stages",
    "clusters",
    "config",
    "recipes",
    "formats",
    "costmodel",
    "families",
    "tuning",
)
# The command-line modules that run job programs in this process: the tools (serve,
# merge-lora, install-triton) are job programs, and `serve` runs the server program here.
RUNS_JOB_PROGRAMS = (PACKAGE / "main.py", PACKAGE / "serving.py")
# What neither the torch-free layers nor the job programs may import.
ABOVE_THE_LAYERS = (
    "launcher_scripts.stages",
    "launcher_scripts.clusters",
    "launcher_scripts.pipeline",
    "launcher_scripts.ops",
    "launcher_scripts.manifest",
    "launcher_scripts.serving",
    "launcher_scripts.main",
    "launcher_scripts.__main__",
    "auto_configurator",
)
LIBRARIES_WITH_TORCH = ("torch", "megatron", "transformers", "transformer_engine", "lm_eval")


def runtime_modules() -> set[str]:
    """The families' torch-side modules, which only job programs import (by these names)."""
    return {family.runtime for family in families.FAMILIES.values() if family.runtime}


def hf_importers() -> set[str]:
    return {family.hf_importer for family in families.FAMILIES.values() if family.hf_importer}


def command_tools() -> set[str]:
    from launcher_scripts.main import TOOLS

    return set(TOOLS.values())


def method_runtimes() -> set[str]:
    """The PEFT methods' torch-side modules (by these names, job programs import them)."""
    return {method.runtime for method in tuning.METHODS.values()}


def method_modules() -> set[str]:
    return {
        f"launcher_scripts.tuning.{m.name}"
        for m in pkgutil.iter_modules(tuning.__path__)
        if m.name != "method"
    }


def reward_modules() -> set[str]:
    """The shipped reward functions' module (a recipe may name any other, the user's own,
    outside this tree)."""
    return {"launcher_scripts.recipes.rewards"}


def curation_step_modules() -> set[str]:
    import launcher_scripts.curation as curation

    return {
        f"launcher_scripts.curation.{m.name}"
        for m in pkgutil.iter_modules(curation.__path__)
        if not m.ispkg
    }


def curation_source_modules() -> set[str]:
    from launcher_scripts.curation import sources

    return {
        f"launcher_scripts.curation.sources.{m.name}"
        for m in pkgutil.iter_modules(sources.__path__)
    }


def family_modules() -> set[str]:
    return {f"launcher_scripts.families.{m.name}" for m in pkgutil.iter_modules(families.__path__)}


# The files that import a module whose name they compute, and the modules that name can be.
DYNAMIC_IMPORTS: dict[str, Callable[[], Iterable[str]]] = {
    "launcher_scripts/main.py": command_tools,  # import_module(TOOLS[command])
    "launcher_scripts/families/__init__.py": family_modules,  # each family module registers
    "launcher_scripts/jobs/models/base.py": runtime_modules,  # import_module(family.runtime)
    "launcher_scripts/jobs/conversion/hf_import.py": hf_importers,  # (family.hf_importer)
    "launcher_scripts/tuning/__init__.py": method_modules,  # each method module registers
    "launcher_scripts/curation/step.py": curation_step_modules,  # each step module registers
    "launcher_scripts/curation/sources/__init__.py": curation_source_modules,  # each source
    "launcher_scripts/jobs/fine_tuning/peft.py": method_runtimes,  # (method.runtime).attach
    "launcher_scripts/jobs/fine_tuning/merge_lora.py": method_runtimes,  # (...).merged
    "launcher_scripts/recipes/grpo.py": reward_modules,  # model.grpo.reward_functions
}


def sources(*folders: Path) -> Iterator[Path]:
    for folder in folders:
        yield from sorted(folder.rglob("*.py")) if folder.is_dir() else [folder]


def is_ours(module: str) -> bool:
    return module.split(".")[0] in ("launcher_scripts", "auto_configurator", "csp_tools", "main")


def is_module(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or path.is_dir()


def import_from(path: Path, node: ast.ImportFrom) -> Iterator[str]:
    """The modules `from M import a, b` loads: M.a where it is a module of ours, else M
    (relative imports resolved)."""
    module = node.module or ""
    if node.level:
        here = path.relative_to(ROOT).with_suffix("").parts[:-1]
        base = here[: len(here) - node.level + 1]
        module = ".".join((*base, *filter(None, [module])))
    for alias in node.names:
        submodule = f"{module}.{alias.name}"
        yield submodule if is_ours(submodule) and is_module(submodule) else module


def is_import_call(node: ast.AST) -> bool:
    """importlib.import_module(...), import_module(...) or __import__(...)."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in ("import_module", "__import__")


def literal_name(call: ast.Call) -> str | None:
    first = call.args[0] if call.args else None
    if isinstance(first, ast.Constant) and isinstance(first.value, str):
        return None if first.value.startswith(".") else first.value
    return None


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """Every module the file imports, at any depth (in functions too, and the type checker's):
    import statements, literal string imports and its declared computed ones."""
    declared = DYNAMIC_IMPORTS.get(path.relative_to(ROOT).as_posix())
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            for module in import_from(path, node):
                yield node.lineno, module
        elif is_import_call(node):
            assert isinstance(node, ast.Call)
            literal = literal_name(node)
            if literal is not None:
                yield node.lineno, literal
            elif declared is not None:
                yield from ((node.lineno, module) for module in declared())


def computed_imports(path: Path) -> Iterator[int]:
    """The lines of the file's imports by a computed name."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if is_import_call(node):
            assert isinstance(node, ast.Call)
            if literal_name(node) is None:
                yield node.lineno


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


def package_of(module: str) -> str | None:
    """The package a module of ours belongs to (None: a library's)."""
    parts = module.split(".")
    if not is_ours(module):
        return None
    if parts[0] == "launcher_scripts" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def package_of_file(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    package = package_of(".".join(parts).removesuffix(".__init__"))
    assert package is not None, path
    return package


# (importer, imported) -> where: "file:line imports module"
Edges = dict[tuple[str, str], list[str]]


def package_imports() -> Edges:
    """Every import from one package of ours to another, with where it is."""
    edges: Edges = {}
    for path in sources(*SOURCES):
        importer = package_of_file(path)
        for line, module in imported_modules(path):
            imported = package_of(module)
            if imported is not None and imported != importer:
                where = f"{path.relative_to(ROOT)}:{line} imports {module}"
                edges.setdefault((importer, imported), []).append(where)
    return edges


def upward_imports(edges: Edges) -> list[str]:
    """The imports of a package of the same layer or one above the importer's."""
    return [
        f"{where} ({importer} may not import {imported}: same layer or above)"
        for (importer, imported), wheres in sorted(edges.items())
        if LAYER_OF[imported] <= LAYER_OF[importer]
        for where in wheres
    ]


def circle(edges: Edges) -> list[str]:
    """A circle of package imports (each step with one import that makes it), or []."""
    following: dict[str, list[str]] = {}
    for importer, imported in sorted(edges):
        following.setdefault(importer, []).append(imported)
    done: set[str] = set()

    def walk(package: str, path: list[str]) -> list[str]:
        if package in path:
            loop = [*path[path.index(package) :], package]
            return [f"{a} -> {b} ({edges[a, b][0]})" for a, b in pairwise(loop)]
        if package in done:
            return []
        for imported in following.get(package, []):
            found = walk(imported, [*path, package])
            if found:
                return found
        done.add(package)
        return []

    for package in sorted(following):
        found = walk(package, [])
        if found:
            return found
    return []


def test_every_package_has_a_layer() -> None:
    """A new package is placed in LAYERS (and the docstring's table) before it is imported."""
    packages = {package_of_file(path) for path in sources(*SOURCES)}
    assert sorted(packages - set(LAYER_OF)) == []


def test_every_computed_import_is_declared() -> None:
    """An import whose name is computed names the modules it can load in DYNAMIC_IMPORTS, so
    that the layer and circle checks see them."""
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sources(*SOURCES)
        if path.relative_to(ROOT).as_posix() not in DYNAMIC_IMPORTS
        for line in computed_imports(path)
    ]
    assert found == []


def test_no_import_runs_up_a_layer_or_sideways() -> None:
    assert upward_imports(package_imports()) == []


def test_the_packages_import_each_other_in_no_circle() -> None:
    assert circle(package_imports()) == []


def test_the_circle_check_finds_a_circle() -> None:
    """What the check above reports for one (the check can fail)."""
    edges = {("a", "b"): ["a.py:1 imports b"], ("b", "a"): ["b.py:2 imports a"]}
    assert circle(edges) == ["a -> b (a.py:1 imports b)", "b -> a (b.py:2 imports a)"]
    assert circle({("a", "b"): ["a.py:1 imports b"]}) == []


def test_the_launcher_side_imports_no_job_program() -> None:
    folders = (
        *(PACKAGE / name for name in LAUNCHER_SIDE),
        *(path for path in PACKAGE.glob("*.py") if path not in RUNS_JOB_PROGRAMS),
    )
    assert violations(folders, ("launcher_scripts.jobs",)) == []


def test_the_recipe_format_family_and_cost_layers_import_no_torch() -> None:
    """Preflight and dry runs load them: importing them loads no torch (a function that
    handles tensors imports it when called)."""
    folders = tuple(PACKAGE / name for name in TORCH_FREE)
    assert violations(folders, LIBRARIES_WITH_TORCH, module_level_imports) == []


def test_the_torch_free_layers_import_nothing_above_them() -> None:
    assert violations(tuple(PACKAGE / name for name in TORCH_FREE), ABOVE_THE_LAYERS) == []


def test_job_programs_import_no_stage_backend_pipeline_serving_or_autoconfigurator() -> None:
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


@pytest.mark.parametrize("name", sorted(families.FAMILIES))
def test_the_name_scan_sees_each_familys_own_name(name: str) -> None:
    """The scan above would see a comparison: it finds each registered family's name where it
    belongs, in the family registry."""
    hits = [hit for path in sources(PACKAGE / "families") for hit in name_literals(path)]
    assert any(hit.endswith(f": {name!r}") for hit in hits), hits


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


def test_the_triton_model_stub_loads_no_torch() -> None:
    """Triton runs one Python stub per model instance (ten for a GPT export), each a thin
    client of the model server: torch there cost each a second of start and stop, and the
    stops, one after another, outran Triton's exit timeout on a busy machine."""
    program = "\n".join(
        [
            "import sys",
            "sys.modules['torch'] = None  # any import of it raises ImportError",
            "from launcher_scripts.jobs.export import triton_model",
            "triton_model.defaults_from({'default_top_k': {'string_value': '2'}})",
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]


def method_literals(path: Path) -> list[str]:
    names = set(tuning.METHODS)
    return [
        f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}"
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
    ]


METHOD_HOMES = (PACKAGE / "tuning", PACKAGE / "jobs" / "fine_tuning" / "methods")


def test_no_module_outside_the_method_registry_names_a_peft_method() -> None:
    """A PEFT method is asked (`settings.method.merges`), never compared by name (no
    `scheme == "lora"`): a new method is one module in tuning/, its torch side in
    jobs/fine_tuning/methods/, and recipes."""
    found = [
        hit
        for path in sources(PACKAGE, ROOT / "auto_configurator", ROOT / "main.py")
        if not any(home in path.parents for home in METHOD_HOMES)
        for hit in method_literals(path)
    ]
    assert found == []


@pytest.mark.parametrize("name", sorted(tuning.METHODS))
def test_the_name_scan_sees_each_methods_own_name(name: str) -> None:
    hits = [hit for path in sources(PACKAGE / "tuning") for hit in method_literals(path)]
    assert any(hit.endswith(f": {name!r}") for hit in hits), hits
