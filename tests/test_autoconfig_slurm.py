"""The AutoConfigurator's measured search on the real single-node Slurm (`.ci/slurm-up.sh`).

`python3 auto_configurator/main.py search_config=gpt3/tiny cluster_type=bcm ...` submits each
candidate as a Slurm job (two srun tasks, gloo on the CPU), follows the jobs with `status`,
and reads their metrics. Without Slurm these tests skip on a developer machine and fail in CI
(CI=true), as tests/test_slurm.py's do.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.support import REPO
from tests.support.autoconfig import AUTOCONFIG, validate_training
from tests.support.commands import ctrl_c_as_in_a_terminal, run_ops

LOGS = Path("gpt3") / "tiny_2gb"  # the gpt3/tiny search config's logs folder under base_results_dir
ACTIVE = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")


def start_search(results: Path, data: Path, *overrides: str) -> subprocess.Popen:
    """The search as a user starts it from a terminal, in the background so the test can act
    on its jobs."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.Popen(
        [
            sys.executable,
            str(AUTOCONFIG),
            "search_config=gpt3/tiny",
            "run_training_hp_search=true",
            "cluster_type=bcm",
            "search_poll_seconds=1",
            f"base_results_dir={results}",
            f"data_dir={data}",
            *overrides,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
        preexec_fn=ctrl_c_as_in_a_terminal,
    )


def submitted_job_id(run_dir: Path, search: subprocess.Popen, timeout: float = 900) -> str:
    """The Slurm job id of a candidate's run, once the launcher has submitted it."""
    link = run_dir / "run_manifest.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert search.poll() is None, search.communicate()
        if link.is_file():
            jobs = json.loads(link.read_text())["stages"][0]["jobs"]
            if jobs[0]["job_ids"]:
                return jobs[0]["job_ids"][0]
        time.sleep(0.2)
    raise AssertionError(f"{run_dir} was not submitted in {timeout} s")


def queued(job_ids: list[str]) -> list[str]:
    """The lines squeue prints for those jobs that have not ended."""
    states = ",".join(ACTIVE)
    result = subprocess.run(
        ["squeue", "-h", "-j", ",".join(job_ids), "-t", states, "-o", "%i %T"],
        capture_output=True,
        text=True,
    )
    return result.stdout.split("\n")[:-1]


@pytest.mark.slow
def test_real_measured_search_on_slurm_picks_the_measured_fastest(
    slurm: None,  # noqa: F811
    prepared: Path,
    tmp_path: Path,
) -> None:
    """Three candidates submitted as Slurm jobs; the third is cancelled while it waits behind
    the others (a 2-CPU node runs one 2-task job at a time), as a user or the scheduler might:
    two are measured, the cancelled one is reported as failed, and the measured fastest wins."""
    search = start_search(
        tmp_path, prepared / "data", "search_config.train_settings.limit_search_runs=3"
    )
    logs = tmp_path / LOGS
    cancelled = submitted_job_id(logs / "training_logs" / "candidate_3", search)
    subprocess.run(["scancel", cancelled], check=True)
    stdout, stderr = search.communicate(timeout=3600)
    assert search.returncode == 0, stdout[-3000:] + stderr[-3000:]

    final = logs / "final_results"
    with open(final / "candidates.csv") as handle:
        rows = {row["run"]: row for row in csv.DictReader(handle) if row["run"]}
    measured = [rows[f"candidate_{i}"] for i in (1, 2)]
    assert [r["status"] for r in measured] == ["measured"] * 2, rows
    for row in measured:
        # A Slurm job whose two srun tasks trained 8 steps; 5 timed after 3 warm-up steps.
        status = json.loads(run_ops("status", row["run_dir"], "--json").stdout)
        assert status["cluster_type"] == "bcm"
        (job,) = status["stages"][0]["jobs"]
        assert job["state"] == "COMPLETED" and job["job_ids"][0].isdigit(), job
        log = Path(job["log"]).read_text()
        assert "rank 1/2 local_rank 1" in log and "launcher slurm" in log, log[-2000:]
        metrics = Path(row["run_dir"]) / "results" / "metrics.jsonl"
        steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
        assert steps == list(range(1, 9)), steps
        assert int(row["measured_steps"]) == 5 and float(row["measured_step_time_s"]) > 0

    # The cancelled job: failed, with the scheduler's state, and no step time.
    third = rows["candidate_3"]
    assert third["status"] == "failed" and third["failure"].startswith("cancelled"), third
    assert third["measured_step_time_s"] == ""
    with open(final / "failed_jobs.csv") as handle:
        (failed,) = list(csv.DictReader(handle))
    assert (failed["run"], failed["state"]) == ("candidate_3", "CANCELLED"), failed
    assert "candidate_3 (" in stdout and "): cancelled" in stdout, stdout[-3000:]

    fastest = min(measured, key=lambda r: float(r["measured_step_time_s"]))
    summary = json.loads((final / "summary.json").read_text())
    assert summary["best"]["run"] == fastest["run"]
    assert (summary["runs"], summary["measured"], summary["failed"]) == (3, 2, 1)
    assert "best: " + fastest["run"] in stdout
    best = Path(summary["best_config"])
    model = OmegaConf.load(best).model
    layout = (model.tensor_model_parallel_size, model.pipeline_model_parallel_size)
    assert layout == (int(fastest["tp"]), int(fastest["pp"]))
    assert model.micro_batch_size == int(fastest["mbs"])
    validate_training(best, f"data_dir={prepared}/data")


@pytest.mark.slow
def test_ctrl_c_cancels_the_runs_it_submitted(
    slurm: None,  # noqa: F811
    prepared: Path,
    tmp_path: Path,
) -> None:
    """An interrupted search leaves no job of its own in the queue."""
    search = start_search(
        tmp_path,
        prepared / "data",
        "search_config.train_settings.limit_search_runs=3",
        # Runs that cannot end before the interrupt, however slowly this machine launches
        # them: with 8 steps the first could finish while the third was still being submitted.
        "search_config.train_settings.max_steps_per_run=1000000",
        "search_config.train_settings.max_minutes_per_run=120",
    )
    logs = tmp_path / LOGS
    ids = [submitted_job_id(logs / "training_logs" / f"candidate_{i}", search) for i in (1, 2, 3)]
    assert len(queued(ids)) == 3  # the first runs, the others wait for the CPUs
    # Interrupt it while it polls: once the last launcher has said it is done.
    last_launch = logs / "training_logs" / "candidate_3" / "autoconfig_launch.out"
    while "all jobs submitted" not in last_launch.read_text():
        assert search.poll() is None, search.communicate()
        time.sleep(0.2)
    search.send_signal(signal.SIGINT)
    _, stderr = search.communicate(timeout=300)
    assert search.returncode != 0
    assert "interrupted: cancelled the 3 submitted runs" in stderr, stderr[-3000:]
    deadline = time.monotonic() + 900  # a cancelled job may save a checkpoint first
    while queued(ids):
        assert time.monotonic() < deadline, queued(ids)
        time.sleep(0.5)
    for i in (1, 2, 3):
        status = json.loads(
            run_ops("status", str(logs / "training_logs" / f"candidate_{i}"), "--json").stdout
        )
        assert status["stages"][0]["jobs"][0]["state"] == "CANCELLED", status
