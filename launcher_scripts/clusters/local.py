"""Run jobs on this machine (a workstation, or inside an interactive allocation).

Each job's script is run by bash in its own process group; its output goes to the terminal
and to the log file as it comes. The pipeline waits for each job, so a failure stops it.

The job's main process is the script's: the script `exec`s its last command, so for a job of
one program (training) it is that program (or torchrun, which forwards signals to its ranks).
The job ends when its main process ends: whatever it left in the process group (the
checkpoint writers of a rank killed by SIGKILL, say, which hold the log pipe open) is ended
then, so the launcher, `status` and `cancel` never wait on leftovers.

Cancel, the same contract as on every backend: a job that checkpoints on a signal (training)
gets SIGTERM on its main process only, so the processes that write its checkpoint live on
while it saves; it has `cluster.signal_grace_seconds` to save and exit (code 75) before its
process group is ended. Other jobs get SIGTERM on the whole group.
"""

from __future__ import annotations

import functools
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from launcher_scripts.clusters.base import (
    COMPANION_LOGS,
    BackendDefaults,
    JobLog,
    JobRecord,
    export_lines,
    format_argv,
    nodes_key,
    python_argv,
    shutdown_env,
    signal_grace_seconds,
    utc_now,
    with_companions,
)
from launcher_scripts.clusters.process_group import kill_group, members, running, send
from launcher_scripts.errors import ConfigError
from launcher_scripts.formats.shards import RANK_VARIABLES
from launcher_scripts.jobspec import JobSpec

CHECKPOINT_SIGNAL = signal.SIGTERM  # what the training program saves and exits 75 on
LEFTOVER_GRACE_SECONDS = 2  # for the job's helper processes to end after its main process
OUTPUT_DRAIN_SECONDS = 30  # the most the launcher reads output after the job's group is gone


class LocalBackend(BackendDefaults):
    name = "local"
    synchronous = True

    def __init__(self, root: Any = None) -> None:
        """`root` is the resolved config: its cluster section's signal_grace_seconds."""
        self.grace = signal_grace_seconds(root.get("cluster") if root is not None else None)

    def jobs_use_launcher_environment(self) -> bool:
        return True  # the launcher's own interpreter runs each job

    def render(self, job: JobSpec) -> str:
        lines = [
            "#!/usr/bin/env bash",
            f"# Stage {job.stage}, job {job.name}: rendered by launcher_scripts (local backend).",
            "# Run it again by hand with: bash <this file>",
            "set -euo pipefail",
            "",
            "# This job does all the work itself, whatever allocation it runs in.",
            # Rank variables inherited from the shell (an salloc allocation sets SLURM_NTASKS,
            # say) would otherwise make a local job process only its share.
            f"unset {' '.join(RANK_VARIABLES)}",
            f"export PYTHONPATH={shlex.quote(job.pythonpath)}${{PYTHONPATH:+:${{PYTHONPATH}}}}",
            *export_lines([*job.env, *shutdown_env(job, self.grace)]),
            f"cd {shlex.quote(job.results_dir)}",
        ]
        for position, command in enumerate(job.commands, start=1):
            argv = format_argv(python_argv(command))
            if position == len(job.commands) and job.companions:
                companions = [(c.name, format_argv(python_argv(c.command))) for c in job.companions]
                log_dir = str(Path(job.results_dir) / COMPANION_LOGS)
                signals = (("TERM", "TERM"), ("INT", "INT"))
                lines += with_companions(argv, companions, log_dir, signals)
                break
            # The last program replaces the shell: signals sent to the job reach it.
            lines += ["", f"exec {argv}" if position == len(job.commands) else argv]
        return "\n".join(lines) + "\n"

    def check_jobs(self, jobs: Sequence[JobSpec]) -> None:
        """The jobs run on this machine alone: a job of several nodes would start one node's
        processes and wait for the rest."""
        for job in jobs:
            if job.resources.nodes > 1:
                raise ConfigError(
                    nodes_key(job),
                    f"job {job.name} asks for {job.resources.nodes} nodes but cluster_type=local "
                    "runs on this machine",
                    f"Set {nodes_key(job)}=1 (trainer.devices processes run here), or use a "
                    "cluster backend (cluster_type=bcm, bcp or k8s)",
                )
        for job in jobs:
            # A container would be silently left out: the jobs run with this interpreter.
            if job.container or job.container_mounts:
                key = "container" if job.container else "container_mounts"
                raise ConfigError(
                    key,
                    "cluster_type=local runs the jobs with this machine's Python and starts no "
                    "container",
                    "Set container=null and container_mounts=[], and start main.py inside the "
                    "container instead (docker run ..., or srun --container-image=... --pty "
                    "bash on a Slurm allocation); or use a cluster backend (cluster_type=bcm, "
                    "bcp or k8s)",
                )

    def check_submission(self, jobs: Sequence[JobSpec]) -> None:
        return None  # no scheduler to ask: check_jobs said what this machine cannot run

    def jobs_find_gpus(self) -> bool | None:
        return _torch_finds_cuda()

    def log_path(self, job: JobSpec, run_id: str) -> str:
        return str(Path(job.results_dir) / f"log-{job.name}_{run_id}.out")

    def submit(
        self,
        script: str,
        job: JobSpec,
        record: JobRecord,
        after: Sequence[str],
        on_start: Callable[[JobRecord], None],
    ) -> None:
        """Run the script to its main process's end, teeing its output into the log."""
        env = dict(os.environ)
        # `python3` in the script is the interpreter running the launcher, as a user expects.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        record.start = utc_now()
        with open(record.log, "ab") as log:
            process = subprocess.Popen(
                ["bash", script],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # so cancel can signal the whole job, and only it
            )
            record.pid = process.pid
            record.job_ids = [f"local-{process.pid}"]
            record.state = "RUNNING"
            record.checkpoint_exit_code = job.checkpoint_exit_code
            record.grace_seconds = self.grace
            on_start(record)
            assert process.stdout is not None
            reader = threading.Thread(target=_tee, args=(process.stdout, log), daemon=True)
            reader.start()
            try:
                code = process.wait()
            except KeyboardInterrupt:
                code = self._interrupted(process, record, log)
                record.state = "CANCELLED"
            _end_leftovers(process.pid, log)
            reader.join(timeout=OUTPUT_DRAIN_SECONDS)
            if reader.is_alive():  # a process that left the job's group holds the pipe
                _say(log, "launcher: processes outside the job's group still hold its output")
            else:
                process.stdout.close()
        record.end = utc_now()
        record.exit_code = _shell_exit_code(code)
        if record.state != "CANCELLED":
            record.state = "COMPLETED" if code == 0 else "FAILED"

    def _interrupted(self, process: subprocess.Popen, record: JobRecord, log: IO[bytes]) -> int:
        """Ctrl-C of the launcher: the cancel contract, with a second Ctrl-C ending it now."""
        try:
            if record.checkpoint_exit_code is None:
                send(-process.pid, signal.SIGINT)
            else:
                send(process.pid, CHECKPOINT_SIGNAL)
                _say(
                    log,
                    f"launcher: asked {record.name} to checkpoint and stop; waiting up to "
                    f"{self.grace} s (Ctrl-C again ends it now)",
                )
            return process.wait(timeout=self.grace)
        except (KeyboardInterrupt, subprocess.TimeoutExpired):
            kill_group(process.pid)
            return process.wait()

    def refresh(self, record: JobRecord) -> None:
        """A RUNNING job whose main process has ended, with no launcher to record how, is
        LOST (leftover processes of its group do not keep it running)."""
        if record.state == "RUNNING" and record.pid is not None and not running(record.pid):
            record.state = "LOST"

    def cancel(self, record: JobRecord) -> int | None:
        if record.pid is None or record.state in ("COMPLETED", "FAILED", "CANCELLED"):
            return None
        if not running(record.pid):
            self.end(record)  # leftovers of a main process that has ended
            return None
        if record.checkpoint_exit_code is not None:
            send(record.pid, CHECKPOINT_SIGNAL)
        else:
            send(-record.pid, signal.SIGTERM)
        return record.grace_seconds or self.grace

    def stopped(self, record: JobRecord) -> bool:
        return record.pid is None or not running(record.pid)

    def end(self, record: JobRecord) -> None:
        if record.pid is not None:
            kill_group(record.pid)

    def logs(self, record: JobRecord) -> list[JobLog]:
        log = Path(record.log)
        return [JobLog(log)] if log.exists() else []


@functools.cache
def _torch_finds_cuda() -> bool | None:
    """Whether torch finds a CUDA GPU in this Python, which runs the jobs: asked of a child
    process, so the launcher itself does not import torch (None: no answer)."""
    try:
        answer = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    words = answer.stdout.split()
    return {"True": True, "False": False}.get(words[-1]) if words else None


def _tee(pipe: IO[bytes], log: IO[bytes]) -> None:
    out = sys.stdout.buffer
    try:
        while chunk := os.read(pipe.fileno(), 65536):
            out.write(chunk)
            out.flush()
            log.write(chunk)
            log.flush()
    except (OSError, ValueError):
        pass  # the launcher stopped waiting for output and closed the log


def _say(log: IO[bytes], line: str) -> None:
    data = f"{line}\n".encode()
    sys.stdout.buffer.write(data)
    sys.stdout.flush()
    log.write(data)
    log.flush()


def _end_leftovers(group: int, log: IO[bytes]) -> None:
    """After the main process ended: end the processes it left in its group, which would
    otherwise hold the log pipe (and the launcher) open. Those that end on their own once it
    has gone (Python's multiprocessing resource tracker, which every training job starts) get
    LEFTOVER_GRACE_SECONDS first, so that only real leftovers are reported."""
    deadline = time.monotonic() + LEFTOVER_GRACE_SECONDS
    left = members(group)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = members(group)
    if left:
        _say(
            log,
            f"launcher: the job's main process ended; ending {len(left)} process(es) it left "
            f"running ({', '.join(map(str, left))})",
        )
    kill_group(group)


def _shell_exit_code(code: int) -> int:
    """Popen's -N for a signal becomes the shell's 128+N."""
    return 128 - code if code < 0 else code
