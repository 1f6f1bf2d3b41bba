"""A job program's refusal of its inputs (a JobError when it starts) is one line for the whole
job, not one per rank followed by torchrun's failure report (launcher_scripts.jobs.refusal and
launcher_scripts.jobs.torchrun)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support import REPO
from tests.support.commands import ONE_THREAD, run_main

# What torchrun says after a process failed: its log lines and its ChildFailedError report.
TORCHRUN_REPORT = ("Traceback", "ChildFailedError", "failed (exitcode", "closing signal", "FAILED")


def torchrun(launcher: str) -> subprocess.CompletedProcess:
    """tests/scripts/refusing_job.py on two processes under `launcher`."""
    return subprocess.run(
        [
            *(sys.executable, "-m", launcher, "--standalone", "--nproc-per-node=2"),
            *("-m", "tests.scripts.refusing_job"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ONE_THREAD,
        timeout=300,
    )


def test_the_launchers_torchrun_prints_the_first_ranks_refusal_once() -> None:
    result = torchrun("launcher_scripts.jobs.torchrun")
    assert result.returncode == 1, result.stderr
    assert result.stderr == "error: job.input: rank 0 refuses it\n"


def test_under_another_torchrun_rank_0_alone_says_it() -> None:
    """torchrun as BCP and Kubernetes run it (srun's tasks alike): rank 0 prints its line, and
    torchrun ends rank 1 while it waits quietly."""
    result = torchrun("torch.distributed.run")
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert lines == ["error: job.input: rank 0 refuses it"], result.stderr


def test_a_local_job_of_two_processes_refused_at_start_says_so_once(
    prepared: Path, tmp_path: Path
) -> None:
    """A training of two ranks whose W&B key file holds no key (preflight sees a file that is
    not empty; the job reads no key in it): each rank refuses at its start."""
    key_file = tmp_path / "wandb_key"
    key_file.write_text("\n")
    results = tmp_path / "results"
    result = run_main(
        "stages=[training]",
        f"data_dir={prepared}/data",
        f"base_results_dir={results}",
        "training.trainer.devices=2",
        "training.exp_manager.create_wandb_logger=true",
        f"wandb_api_key_file={key_file}",
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    refusal = "error: wandb_api_key_file: the file it names is empty: put the W&B API key in it"
    output = result.stdout + result.stderr
    assert output.count(refusal) == 1, output
    for report in TORCHRUN_REPORT:
        assert report not in output, output
    (log,) = (results / "gpt3_tiny").glob("log-gpt3_tiny_*.out")
    assert log.read_text().count(refusal) == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: stage training, job gpt3_tiny failed with exit code 1"), last


def test_a_crash_still_gets_torchruns_whole_report(tmp_path: Path) -> None:
    """Not a refusal (an exception of the program's own): torchrun's report is kept."""
    program = tmp_path / "crashing.py"
    program.write_text("raise ValueError('a bug')\n")
    result = subprocess.run(
        [
            *(sys.executable, "-m", "launcher_scripts.jobs.torchrun", "--standalone"),
            *("--nproc-per-node=2", str(program)),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ONE_THREAD,
        timeout=300,
    )
    assert result.returncode == 1
    assert "ValueError: a bug" in result.stderr
    assert "ChildFailedError" in result.stderr
