"""Shared fixtures and options.

Regenerate golden scripts with: python3 -m pytest tests/test_golden_scripts.py --update-goldens
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher_scripts.jobs.export.install import bundled_server, default_venv, venv_python

pytest_plugins = ["tests.http_site"]  # the `site` fixture: a local HTTP server

REPO = Path(__file__).resolve().parents[1]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-goldens",
        action="store_true",
        help="rewrite tests/golden/ from the current renderers instead of comparing",
    )


@pytest.fixture
def update_goldens(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-goldens"))


def run_main(
    *overrides: str, cwd: Path | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """`python3 main.py overrides...` as a user runs it, capturing its output."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.run(
        [sys.executable, str(REPO / "main.py"), *overrides],
        capture_output=True,
        text=True,
        cwd=cwd or REPO,
        env=env,
        timeout=timeout,
    )


def run_ops(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`python3 -m launcher_scripts status|logs|cancel ...`."""
    return subprocess.run(
        [sys.executable, "-m", "launcher_scripts", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )


def write_run_manifest(results: Path, *jobs: dict) -> Path:
    """A run manifest of one local data_preparation stage holding `jobs` (fields of
    launcher_scripts.clusters.JobRecord), as a launcher would have written it; returns it."""
    run_dir = results / "runs" / "r1"
    run_dir.mkdir(parents=True)
    defaults = {
        "stage": "data_preparation",
        "backend": "local",
        "script": "s.sh",
        "log": str(results / "log"),
        "state": "RUNNING",
        "exit_code": None,
        "start": "2026-01-01T00:00:00+00:00",
        "end": None,
    }
    manifest = {
        "run_id": "r1",
        "created": "r1",
        "command": ["main.py"],
        "cluster_type": "local",
        "git_revision": None,
        "launcher_pid": os.getpid(),
        "stages": [
            {
                "stage": "data_preparation",
                "results_dir": str(results),
                "config": "c.yaml",
                "jobs": [{**defaults, **job} for job in jobs],
                "artifacts": [],
            }
        ],
    }
    path = run_dir / "manifest.json"
    path.write_text(json.dumps(manifest))
    return path


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default data preparation (shipped corpus, trained tokenizer), done once."""
    root = tmp_path_factory.mktemp("prepared")
    result = run_main(
        "stages=[data_preparation]", f"data_dir={root}/data", f"base_results_dir={root}/results"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return root


@pytest.fixture(scope="session")
def tiny_portable(prepared: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GPT trained briefly and converted: the portable file inference stages read."""
    results = tmp_path_factory.mktemp("tiny_model")
    result = run_main(
        "stages=[training,conversion]",
        f"data_dir={prepared}/data",
        f"base_results_dir={results}",
        "training.trainer.max_steps=60",
        "conversion.run.hf_dir_name=null",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return results / "gpt3_tiny" / "convert_nemo" / "megatron_gpt.nemo"


@pytest.fixture(scope="session")
def triton_python() -> Path:
    venv = default_venv()
    if not (bundled_server(venv) / "bin" / "tritonserver").is_file():
        message = f"no Triton server in {venv}: run `python3 -m launcher_scripts install-triton`"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return venv_python(venv)


@pytest.fixture(scope="session")
def exported(tiny_portable: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The export stage run by main.py on the tiny model; returns its results dir."""
    results = tmp_path_factory.mktemp("export")
    result = run_main(
        "stages=[export]",
        f"base_results_dir={results}",
        f"export.model.nemo_file={tiny_portable}",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return results / "gpt3_tiny" / "export"
