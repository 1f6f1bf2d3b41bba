"""Helpers the tests share; fixtures and pytest hooks stay in the conftest beside them.

Each module holds one kind of helper: `commands` (running main.py, the ops commands and the
checkout's programs), `slurm`, `triton`, `training`, `conversion`, `golden_cases`, `packaging`,
`manifests`, `session_builds`, and the hooks' own `scheduling`, `markers` and `timings`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def missing(message: str) -> None:
    """A real part the test needs is not here: a failure in CI (CI=true), a skip elsewhere."""
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)
