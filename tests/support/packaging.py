"""The launcher built as a wheel and installed in a fresh venv, as a user installs it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.support import REPO

# The CPU build the local index serves; without it first, pip would pull torch's CUDA packages.
TORCH_PIN = "torch==2.13.0"
PIP_QUIET = {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_ROOT_USER_ACTION": "ignore"}


def source_files(root: Path = REPO) -> list[str]:
    """The checkout's files as a clean clone holds them, plus new ones not yet committed (not
    ignored ones: build/, results/, a developer's data/)."""
    listed = subprocess.run(
        ["git", "-C", str(root), "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        capture_output=True,
        check=True,
    ).stdout.decode()
    return sorted(name for name in listed.split("\0") if name and (root / name).is_file())


def build_wheel(destination: Path) -> Path:
    """The launcher's wheel, built from a copy of the source files: never from the checkout
    itself, whose build/ may hold modules deleted since."""
    source = destination / "source"
    for name in source_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    dist = destination / "dist"
    build = ["pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(dist)]
    subprocess.run(
        [sys.executable, "-m", *build, str(source)],
        check=True,
        env={**os.environ, **PIP_QUIET},
        timeout=600,
    )
    (wheel,) = dist.glob("llm_launcher-*.whl")
    return wheel


@dataclass(frozen=True)
class InstalledLauncher:
    """The wheel installed with its `train` extra (not `wandb`) in a fresh venv: a user's
    `pip install`, without the checkout or the system's packages."""

    venv: Path
    wheel: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def environment(self) -> dict[str, str]:
        """This process's environment without what would import the checkout instead."""
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR", "VIRTUAL_ENV", "PYTHONHOME")
        }
        env["PATH"] = os.pathsep.join([str(self.venv / "bin"), env.get("PATH", "")])
        return env

    def run(self, argv: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
        """A command of the venv (`llm-launcher`, `python`) run in `cwd`, output captured."""
        program = str(self.venv / "bin" / argv[0])
        return subprocess.run(
            [program, *argv[1:]],
            capture_output=True,
            text=True,
            cwd=cwd,
            env=self.environment(),
            timeout=timeout,
        )

    def site_packages(self) -> Path:
        (found,) = self.venv.glob("lib/python*/site-packages")
        return found


def install_launcher(wheel: Path, venv: Path) -> InstalledLauncher:
    """The wheel with its `train` extra in a new venv at `venv`."""
    # No pip of its own: this process's pip installs into it (`pip --python`). The pip that
    # `venv` would bundle is the one Python shipped with, whose candidate search took twice as
    # long as a current pip's for the train extra's dependency tree (59 CPU-s against 26);
    # .ci/run upgrades this process's pip.
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300
    )
    # --no-compile: byte-compiling every module of torch and transformers was half the
    # install; Python compiles what the tests import as it imports it.
    target = ["--python", str(venv / "bin" / "python")]
    pip = [sys.executable, "-m", "pip", *target, "install", "--quiet", "--no-compile"]
    env = {**os.environ, **PIP_QUIET}
    env.pop("PYTHONPATH", None)
    for requirement in (TORCH_PIN, f"{wheel}[train]"):
        result = subprocess.run(
            [*pip, requirement], capture_output=True, text=True, env=env, timeout=1800
        )
        assert result.returncode == 0, f"pip install {requirement}:\n{result.stderr[-3000:]}"
    return InstalledLauncher(venv, wheel)
