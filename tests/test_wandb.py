"""Weights & Biases: a key pasted where its file's path belongs is never shown back, by the
launcher or by a job; a resumed training continues its W&B run. wandb runs for real, offline
(WANDB_MODE=offline: no network, no account). Without wandb installed: tests/test_packaging.py.
"""

from __future__ import annotations

import secrets
import subprocess
from pathlib import Path

import pytest

from tests.support.commands import run_main

WANDB_OFF_LINE = ["+env_vars.WANDB_MODE=offline"]
SHORT_WARMUP = "training.model.optim.sched.warmup_steps=1"  # runs of a few steps


def pasted_key() -> str:
    """What a W&B API key looks like: 40 hex digits."""
    return secrets.token_hex(20)


def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "wandb.key"
    path.write_text(f"{pasted_key()}\n")
    return path


@pytest.mark.parametrize("dry_run", ["true", "false"])
@pytest.mark.parametrize("kind", ["no such file", "a folder", "an empty file"])
def test_the_key_file_setting_is_never_shown_back(tmp_path: Path, kind: str, dry_run: str) -> None:
    """Every way preflight can refuse `wandb_api_key_file` leaves its value out of the line."""
    value = {
        "no such file": pasted_key(),
        "a folder": str(tmp_path / f"folder-{pasted_key()}"),
        "an empty file": str(tmp_path / f"empty-{pasted_key()}"),
    }[kind]
    if kind == "a folder":
        Path(value).mkdir()
    if kind == "an empty file":
        Path(value).touch()
    results = tmp_path / "results"
    result = run_main(
        "stages=[training]",
        f"base_results_dir={results}",
        f"wandb_api_key_file={value}",
        f"dry_run={dry_run}",
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: wandb_api_key_file:"), lines
    assert value not in result.stdout + result.stderr
    assert Path(value).name not in result.stdout + result.stderr
    assert not results.exists()


def job_output(results: Path, result: subprocess.CompletedProcess) -> str:
    """What a user sees of a run: the launcher's output and every job log."""
    logs = "".join(p.read_text(errors="replace") for p in results.rglob("log-*.out"))
    return result.stdout + result.stderr + logs


def test_a_job_does_not_show_a_key_given_as_its_key_file(prepared: Path, tmp_path: Path) -> None:
    """A key put in the job's WANDB_API_KEY_FILE directly (an env_vars entry, which preflight
    does not read as a path) stops the job at its start, in one line without the key."""
    key = pasted_key()
    results = tmp_path / "results"
    result = run_main(
        "stages=[training]",
        f"data_dir={prepared}/data",
        f"base_results_dir={results}",
        "training.trainer.max_steps=1",
        SHORT_WARMUP,
        "training.exp_manager.create_wandb_logger=True",
        f"+env_vars.WANDB_API_KEY_FILE={key}",
        *WANDB_OFF_LINE,
        cwd=tmp_path,
    )
    output = job_output(results, result)
    assert result.returncode != 0, output[-3000:]
    assert key not in output
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error: wandb_api_key_file")]
    assert errors, output[-3000:]


def wandb_runs(log_dir: Path) -> list[str]:
    """The ids of the W&B runs the job attempts wrote offline, oldest first (one folder per
    attempt: offline-run-<time>-<id>[-n], holding run-<id>.wandb)."""
    folders = sorted((log_dir / "wandb").glob("offline-run-*"), key=lambda p: p.stat().st_mtime)
    ids = []
    for folder in folders:
        (record,) = folder.glob("run-*.wandb")
        ids.append(record.stem.removeprefix("run-"))
    return ids


@pytest.mark.slow
def test_a_resumed_training_continues_its_wandb_run(prepared: Path, tmp_path: Path) -> None:
    """Stopped at step 2 and resumed to step 4 (as after a requeue): one W&B run id across both
    attempts. Training again without a checkpoint to resume from starts a new W&B run."""
    results = tmp_path / "results"
    log_dir = results / "gpt3_tiny" / "results"
    home = tmp_path / "home"  # wandb's settings and caches, away from the user's

    def train(max_steps: int) -> str:
        result = run_main(
            "stages=[training]",
            f"data_dir={prepared}/data",
            f"base_results_dir={results}",
            f"training.trainer.max_steps={max_steps}",
            "training.trainer.log_every_n_steps=1",
            SHORT_WARMUP,
            "training.exp_manager.create_wandb_logger=True",
            "training.exp_manager.wandb_logger_kwargs.project=launcher-test",
            f"wandb_api_key_file={key_file(tmp_path)}",
            *WANDB_OFF_LINE,
            f"+env_vars.WANDB_CONFIG_DIR={home}/config",
            f"+env_vars.WANDB_CACHE_DIR={home}/cache",
            f"+env_vars.WANDB_DATA_DIR={home}/data",
            cwd=tmp_path,
            timeout=1200,
        )
        output = job_output(results, result)
        assert result.returncode == 0, output[-3000:]
        return output

    train(2)
    (first,) = wandb_runs(log_dir)
    output = train(4)
    assert "resumed from" in output and "at step 2" in output
    assert wandb_runs(log_dir) == [first, first]

    for checkpoint in (log_dir / "checkpoints").iterdir():
        checkpoint.rename(tmp_path / f"old-{checkpoint.name}")
    train(2)
    runs = wandb_runs(log_dir)
    assert len(runs) == 3 and runs[2] != first
