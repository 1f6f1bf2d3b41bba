"""The life of a local job with real processes: the tiny model trained on the CPU, killed with
SIGKILL or cancelled, as a user would (`python3 main.py`, `python3 -m launcher_scripts
status|cancel` from another shell)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pytest

from launcher_scripts.formats.progress import TMP_PREFIX, newest_step
from tests.support import REPO
from tests.support.commands import ctrl_c_as_in_a_terminal, run_main, run_ops
from tests.support.manifests import write_run_manifest

PRETRAIN = "launcher_scripts.jobs.training.pretrain"
# Long enough never to finish while a test waits; a checkpoint every few steps.
LONG_TRAINING = (
    "stages=[training]",
    "training.trainer.max_steps=100000",
    "training.trainer.log_every_n_steps=1",
    "training.trainer.val_check_interval=100000",
    "training.exp_manager.checkpoint_callback_params.every_n_train_steps=3",
)
WAIT = 600  # seconds any one condition may take on a busy machine


def wait_until(condition: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout} s: {what}")


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent, process group) from /proc, None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[2])


def dead(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is None or stat[0] == "Z"


def group_processes(group: int) -> list[int]:
    """The live processes (zombies are dead) of a process group."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = proc_stat(int(entry.name))
            if stat and stat[2] == group and stat[0] != "Z":
                found.append(int(entry.name))
    return sorted(found)


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def training_process(group: int) -> int:
    """The training program of a one-process job: the process of the group running it whose
    parent does not (megatron-core's helper processes run other command lines)."""
    programs = [pid for pid in group_processes(group) if PRETRAIN in command_line(pid)]
    tops = [pid for pid in programs if (proc_stat(pid) or ("", 0, 0))[1] not in programs]
    assert len(tops) == 1, {pid: command_line(pid) for pid in group_processes(group)}
    return tops[0]


def status(results: Path) -> dict[str, Any]:
    result = run_ops("status", str(results), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["stages"][0]["jobs"][0]


class Launcher:
    """`python3 main.py ...` in the background, its output in files (a pipe nobody reads
    would stall it)."""

    def __init__(self, folder: Path, *overrides: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = folder / "launcher.out", folder / "launcher.err"
        self.out: IO[bytes] = self.out_path.open("wb")
        self.err: IO[bytes] = self.err_path.open("wb")
        env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
        self.process = subprocess.Popen(
            [sys.executable, str(REPO / "main.py"), *overrides],
            stdout=self.out,
            stderr=self.err,
            cwd=REPO,
            env=env,
            preexec_fn=ctrl_c_as_in_a_terminal,  # one test stops it as ctrl-c would
        )
        self.group: int | None = None

    def job_group(self, results: Path) -> int:
        """The job's process group, once the manifest records it."""
        manifest = results / "runs"
        wait_until(lambda: list(manifest.glob("*/manifest.json")), "the run manifest")
        self.group = wait_until(lambda: status(results)["pid"], "the job to start")
        return self.group

    def wait(self) -> int:
        return self.process.wait(timeout=WAIT)

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    def close(self) -> None:
        """Whatever happened, leave no process of the test behind."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.group is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.group, signal.SIGKILL)
        self.out.close()
        self.err.close()


def first_checkpoint_taken(checkpoints: Path) -> Callable[[], bool]:
    return lambda: newest_step(checkpoints) > 0


@pytest.mark.slow
@pytest.mark.parametrize("launcher_state", ["launcher-alive", "launcher-killed"])
def test_sigkill_of_the_training_ends_the_job_and_what_it_left(
    prepared: Path, tmp_path: Path, launcher_state: str
) -> None:
    """megatron-core's checkpoint writer processes outlive a rank killed with SIGKILL and hold
    the job's output open: the launcher still ends the job (FAILED), `status` does not say
    RUNNING, and nothing of the job is left running."""
    results = tmp_path / "results"
    launcher = Launcher(
        tmp_path, *LONG_TRAINING, f"data_dir={prepared}/data", f"base_results_dir={results}"
    )
    try:
        group = launcher.job_group(results)
        checkpoints = results / "gpt3_tiny" / "results" / "checkpoints"
        wait_until(first_checkpoint_taken(checkpoints), "a first checkpoint")
        trainer = training_process(group)
        helpers = [pid for pid in group_processes(group) if PRETRAIN not in command_line(pid)]
        assert helpers, "no checkpoint writer process: the case this test is about is gone"
        if launcher_state == "launcher-killed":
            launcher.process.kill()
            launcher.process.wait()
        with contextlib.suppress(ProcessLookupError):  # it may die of its closed output too
            os.kill(trainer, signal.SIGKILL)
        if launcher_state == "launcher-alive":
            assert launcher.wait() == 137, launcher.stderr
            assert "failed with exit code 137" in launcher.stderr
            assert status(results)["state"] == "FAILED"
        else:
            wait_until(lambda: dead(trainer), "the killed trainer to be dead")
            assert status(results)["state"] == "LOST"
            cancelled = run_ops("cancel", str(results), timeout=WAIT)
            assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
            assert status(results)["state"] == "LOST"
        assert group_processes(group) == []
    finally:
        launcher.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "processes"),
    [("cancel", 1), ("cancel", 2), ("ctrl-c", 1)],
    ids=["cancel-one-process", "cancel-torchrun-two-ranks", "ctrl-c-of-the-launcher"],
)
def test_cancel_checkpoints_the_training_and_a_rerun_resumes_from_it(
    prepared: Path, tmp_path: Path, how: str, processes: int
) -> None:
    results = tmp_path / "results"
    overrides = (
        f"data_dir={prepared}/data",
        f"base_results_dir={results}",
        f"training.trainer.devices={processes}",
    )
    launcher = Launcher(tmp_path, *LONG_TRAINING, *overrides)
    log_dir = results / "gpt3_tiny" / "results"
    checkpoints = log_dir / "checkpoints"
    try:
        group = launcher.job_group(results)
        wait_until(first_checkpoint_taken(checkpoints), "a first checkpoint")
        before = newest_step(checkpoints)
        # Some steps past it, which a cancel that saves nothing would lose.
        wait_until(lambda: last_logged_step(log_dir) >= before + 2, "steps past the checkpoint")
        if how == "cancel":
            cancelled = run_ops("cancel", str(results), timeout=WAIT)
            assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
            assert "sent its checkpoint signal" in cancelled.stdout, cancelled.stdout
            assert "gpt3_tiny: stopped" in cancelled.stdout, cancelled.stdout
        else:
            launcher.process.send_signal(signal.SIGINT)
        assert launcher.wait() != 0
        assert "was cancelled" in launcher.stderr
    finally:
        launcher.close()
    record = status(results)
    assert record["state"] == "CANCELLED"
    if processes == 1:  # torchrun reports its ranks' stop as its own failure
        assert record["exit_code"] == 75
    log = Path(record["log"]).read_text()
    assert "checkpoint saved; exit code 75" in log
    assert "BrokenPipeError" not in log
    if processes == 1:  # (torchrun prints its own stop as a traceback)
        assert "Traceback" not in log
    after = newest_step(checkpoints)
    assert after > before
    assert not [p.name for p in checkpoints.iterdir() if p.name.startswith(TMP_PREFIX)]
    assert group_processes(group) == []

    if (how, processes) != ("cancel", 1):
        return  # resuming from a saved checkpoint is the same for each way of stopping
    # The same command resumes from the cancel's checkpoint (stopped here by max_time).
    rerun = run_main(*LONG_TRAINING, *overrides, "training.trainer.max_time=00:00:00:01")
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert f"at step {after} " in rerun.stdout, rerun.stdout[-3000:]
    assert newest_step(checkpoints) > after


def last_logged_step(log_dir: Path) -> int:
    metrics = log_dir / "metrics.jsonl"
    if not metrics.exists():
        return 0
    steps = [
        json.loads(line).get("step", 0)
        for line in metrics.read_text().splitlines()
        if line.endswith("}")  # a line being written is skipped
    ]
    return max(steps, default=0)


def stubborn_job() -> subprocess.Popen:
    """A job (its own session and process group, as the launcher starts one) whose processes
    ignore SIGTERM, as a program stuck in a collective would."""
    job = subprocess.Popen(
        ["bash", "-c", "trap '' TERM; sleep 1000 & echo ready; wait"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert job.stdout is not None and job.stdout.readline() == "ready\n"
    return job


@pytest.mark.parametrize("now", [False, True], ids=["after-the-grace", "now"])
def test_cancel_ends_a_job_that_does_not_stop_on_its_signal(tmp_path: Path, now: bool) -> None:
    job = stubborn_job()
    try:
        write_run_manifest(
            tmp_path,
            {
                "name": "stubborn",
                "job_ids": [f"local-{job.pid}"],
                "pid": job.pid,
                "checkpoint_exit_code": 75,
                # --now does not wait for it; without, it passes, then the job is ended.
                "grace_seconds": 100000 if now else 1,
            },
        )
        result = run_ops("cancel", *(["--now"] if now else []), str(tmp_path), timeout=WAIT)
        assert result.returncode == 0, result.stdout + result.stderr
        if not now:
            assert "stubborn: did not stop within its grace period: ended it" in result.stdout
        assert job.wait(timeout=WAIT) == -signal.SIGKILL
        assert group_processes(job.pid) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)


# As a rank's first checkpoint save: megatron-core spawns a manager process whose queue the
# save writes through, and its process group is signalled meanwhile (torchrun, srun and
# Kubernetes signal the group). The launcher's modules are imported under __main__ only: the
# spawned manager imports this script again, and would import torch and megatron-core for
# nothing (seconds of CPU) before it starts serving.
SAVE_UNDER_SIGNAL = """
import multiprocessing, os, signal

if __name__ == "__main__":
    from launcher_scripts.jobs.training.checkpointing import stop_signals_held
    from launcher_scripts.jobs.training.pretrain import StopSignals

    stop = StopSignals()
    with stop_signals_held():
        manager = multiprocessing.get_context("spawn").Manager()
        queue = manager.Queue()
        os.killpg(0, signal.SIGTERM)
        queue.put("written")
    print(queue.get(), "stop requested:", stop.received == signal.SIGTERM, flush=True)
"""


def test_processes_a_save_starts_outlive_the_signal_to_the_group(tmp_path: Path) -> None:
    script = tmp_path / "save_under_signal.py"
    script.write_text(SAVE_UNDER_SIGNAL)
    process = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        start_new_session=True,  # the group it signals is its own
        timeout=WAIT,
    )
    assert process.returncode == 0, process.stdout + process.stderr
    assert process.stdout.strip() == "written stop requested: True"
