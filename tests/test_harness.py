"""The test harness's own rules: pytest collects every test (none hides in a conftest), and
shared helpers live in tests/support/, not in conftest or in another test module."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import REPO

TESTS = REPO / "tests"


def python_files() -> list[Path]:
    return sorted(TESTS.rglob("*.py"))


def test_no_test_is_defined_in_a_conftest() -> None:
    """pytest does not collect tests from conftest.py: one defined there never runs."""
    found = [
        f"{path.relative_to(REPO)}:{node.lineno} {node.name}"
        for path in TESTS.rglob("conftest.py")
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        and node.name.lower().startswith("test")
    ]
    assert found == [], "move these into a test module: " + ", ".join(found)


def imported_test_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        names += [
            f"{path.relative_to(REPO)}:{node.lineno} imports {module}"
            for module in modules
            if module.rsplit(".", 1)[-1] == "conftest" or module.startswith("tests.test_")
        ]
    return names


def test_helpers_are_imported_from_support_not_from_conftest_or_test_modules() -> None:
    """A conftest holds what pytest reads (hooks, fixtures), a test module its tests: what a
    module imports lives in tests/support/, in a module named for what it holds."""
    found = [hit for path in python_files() for hit in imported_test_modules(path)]
    assert found == [], "move what these import into tests/support/: " + "; ".join(found)
