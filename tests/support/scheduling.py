"""Which xdist worker runs a test: tests sharing one machine-wide thing, or one module-scoped
fixture, stay on one worker, one after another."""

from __future__ import annotations

from pathlib import Path

import pytest

# Fixtures standing for something one machine has once: the tests using one run on one xdist
# worker, one after another (a second Triton server would change the processes a serving test
# counts; Slurm tests wait on the one node's queue; the bcprun shim's nodes all rendezvous at
# the BCP backend's fixed port on this machine, so two BCP jobs at once would meet each other).
SHARED = {
    "slurm": "slurm",
    "bcp_node": "bcp",
    "default_run": "triton",
    "exported": "triton",
    "triton_python": "triton",
    # A venv with torch, removed when its worker's session ends.
    "installed_launcher": "packaging",
}


def shared_group(item: pytest.Item) -> str | None:
    return next((SHARED[f] for f in getattr(item, "fixturenames", ()) if f in SHARED), None)


def uses_own_module_fixture(item: pytest.Item) -> bool:
    """Whether the test uses a module-scoped fixture of its module (a trained model, a measured
    search): one is built once per worker that runs one of its tests."""
    module = item.nodeid.split("::")[0]
    info = getattr(item, "_fixtureinfo", None)
    return any(
        definitions[-1].scope == "module" and definitions[-1].baseid == module
        for definitions in getattr(info, "name2fixturedefs", {}).values()
        if definitions
    )


def assign_xdist_groups(items: list[pytest.Item]) -> None:
    """Mark each test that must share a worker with `xdist_group`. The tests of a module
    fixture stay on one worker: in the module's shared group if some of its tests have one,
    else in a group of the module's own."""
    module_group: dict[str, str] = {}
    for item in items:
        group = shared_group(item)
        if group is not None:
            module_group.setdefault(item.nodeid.split("::")[0], group)
    for item in items:
        group = shared_group(item)
        own_group = item.get_closest_marker("xdist_group") is not None
        if group is None and not own_group and uses_own_module_fixture(item):
            module = item.nodeid.split("::")[0]
            group = module_group.get(module, Path(module).stem)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
