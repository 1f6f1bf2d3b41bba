"""`python3 -m launcher_scripts install-triton`: a Triton server with its Python backend, from
PyPI, in a virtual environment of its own.

The server comes inside the `nvidia-pytriton` wheel; `tritonclient` is the client
docs/export_and_serving.md and the tests use. The environment sees this Python's packages
(torch, megatron-core, the launcher) but has its own numpy 1.x, which the wheel's
Python-backend stub needs and which would otherwise clash with a numpy 2 installation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PACKAGES = ("nvidia-pytriton==0.7.0", "tritonclient[http,grpc]==2.73.0", "numpy==1.26.4")
VENV_VARIABLE = "LLM_LAUNCHER_TRITON_VENV"


def default_venv() -> Path:
    configured = os.environ.get(VENV_VARIABLE)
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "llm-launcher" / "triton-venv"


def site_packages(venv: Path) -> Path:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return venv / "lib" / version / "site-packages"


def bundled_server(venv: Path) -> Path:
    """Where the wheel puts Triton: bin/tritonserver, backends/, python_backend_stubs/."""
    return site_packages(venv) / "pytriton" / "tritonserver"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def pip(venv: Path) -> list[str]:
    """The pip that installs into `venv`: this Python's own through `--python` (pip 22.3 and
    later), which the user keeps current, rather than the one `venv` bundled with Python, whose
    candidate search for these packages is several times slower; else the venv's."""
    try:
        release = tuple(int(part) for part in version("pip").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        release = ()
    if release >= (22, 3):
        return [sys.executable, "-m", "pip", "--python", str(venv_python(venv))]
    return [str(venv_python(venv)), "-m", "pip"]


def up_to_date(venv: Path) -> bool:
    """Whether pip would install nothing: every pinned package (extras' dependencies too) is
    there. A pip too old for `--dry-run --report` answers False, and the install runs."""
    asked = subprocess.run(
        [*pip(venv), "install", "--dry-run", "--quiet", "--report", "-", *PACKAGES],
        capture_output=True,
        text=True,
    )
    try:
        return asked.returncode == 0 and json.loads(asked.stdout)["install"] == []
    except (ValueError, KeyError):
        return False


def install(venv: Path) -> None:
    if not venv_python(venv).is_file():
        print(f"creating {venv}", flush=True)
        subprocess.run(
            [sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True
        )
    elif up_to_date(venv):
        print(f"already installed in {venv}: {', '.join(PACKAGES)}", flush=True)
        return
    print(f"installing {', '.join(PACKAGES)} into {venv} (about 400 MB)", flush=True)
    subprocess.run(
        [*pip(venv), "install", "--progress-bar", "on", *PACKAGES],
        check=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m launcher_scripts install-triton",
        description="Install a Triton server (Python backend) and tritonclient into a venv.",
    )
    parser.add_argument(
        "--venv",
        type=Path,
        default=default_venv(),
        help=f"where (default {default_venv()}; or set ${VENV_VARIABLE})",
    )
    args = parser.parse_args(argv)
    try:
        install(args.venv)
    except subprocess.CalledProcessError as error:
        print(
            f"error: installing failed (exit {error.returncode}); see pip's output above",
            file=sys.stderr,
        )
        return 1
    if args.venv.resolve() == default_venv().resolve():
        print(f"done: `python3 -m launcher_scripts serve EXPORT_DIR` now finds it in {args.venv}")
    else:
        print(f"done: set {VENV_VARIABLE}={args.venv} for `serve` to find it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
