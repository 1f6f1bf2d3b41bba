"""The markers `slurm`, `triton` and `slow`, given by the fixtures a test uses, so that
`pytest -m "not slow"` is the fast tier: what needs no training, no server and no install.

A test that trains or starts a server in its own body carries `@pytest.mark.slow` (or its
module's `pytestmark`); one that takes such a fixture is marked here.
"""

from __future__ import annotations

import pytest

# Registered in pyproject.toml ([tool.pytest.ini_options] markers), with what each means.
BY_FIXTURE: dict[str, tuple[str, ...]] = {
    "slurm": ("slurm",),
    "slurm_nodes": ("slurm",),
    "triton_python": ("triton", "slow"),
    # Session fixtures that train a model or install the launcher.
    "default_run": ("slow",),
    "tiny_portable": ("slow",),
    "exported": ("slow",),
    "t5_converted": ("slow",),
    "installed_launcher": ("slow",),
}


def mark_by_fixtures(items: list[pytest.Item]) -> None:
    for item in items:
        names = {
            marker
            for fixture in getattr(item, "fixturenames", ())
            for marker in BY_FIXTURE.get(fixture, ())
        }
        for name in sorted(names):
            if item.get_closest_marker(name) is None:
                item.add_marker(getattr(pytest.mark, name))
