"""The AutoConfigurator run as a user runs it; the training stage's own check of a recipe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from launcher_scripts.config.compose import compose_config
from launcher_scripts.config.preflight import resolve
from launcher_scripts.stages import STAGES, StageContext
from tests.support import REPO

AUTOCONFIG = REPO / "auto_configurator" / "main.py"


def run_autoconfig(*overrides: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """`python3 auto_configurator/main.py overrides...` as a user runs it."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.run(
        [sys.executable, str(AUTOCONFIG), *overrides],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=timeout,
    )


def validate_training(recipe: Path, *overrides: str) -> None:
    """The training stage's own validation of a recipe file, as `main.py` runs it."""
    root = compose_config(["stages=[training]", f"training={recipe}", *overrides])
    resolved = resolve(root, ["training"])
    STAGES["training"].validate(StageContext(resolved, "training"))
