"""Run jobs on this machine (a workstation, or inside an interactive allocation).

Each job's script is run by bash in its own process group; its output goes to the terminal
and to the log file as it comes. The pipeline waits for each job, so a failure stops it.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from launcher_scripts.clusters.base import (
    JobLog,
    JobRecord,
    export_lines,
    format_argv,
    python_argv,
    utc_now,
)
from launcher_scripts.jobs.data_prep.shards import RANK_VARIABLES
from launcher_scripts.jobspec import JobSpec


class LocalBackend:
    name = "local"
    synchronous = True

    def __init__(self, root: object = None) -> None:
        """`root` is the resolved config; the local backend needs nothing from it."""

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
            *export_lines(job.env),
            f"cd {shlex.quote(job.results_dir)}",
        ]
        for command in job.commands:
            lines += ["", format_argv(python_argv(command))]
        return "\n".join(lines) + "\n"

    def check_submission(self, jobs: Sequence[JobSpec]) -> None:
        """Nothing to check: the jobs run here."""

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
        """Run the script to completion, teeing its output into the log."""
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
            on_start(record)
            try:
                _tee(process, log)
                code = process.wait()
            except KeyboardInterrupt:
                os.killpg(process.pid, signal.SIGINT)
                code = process.wait()
                record.state = "CANCELLED"
        record.end = utc_now()
        record.exit_code = _shell_exit_code(code)
        if record.state != "CANCELLED":
            record.state = "COMPLETED" if code == 0 else "FAILED"

    def refresh(self, record: JobRecord) -> None:
        if record.state == "RUNNING" and record.pid is not None and not _alive(record.pid):
            record.state = "LOST"

    def cancel(self, record: JobRecord) -> None:
        if record.state == "RUNNING" and record.pid is not None and _alive(record.pid):
            os.killpg(record.pid, signal.SIGTERM)

    def logs(self, record: JobRecord) -> list[JobLog]:
        log = Path(record.log)
        return [JobLog(log)] if log.exists() else []


def _tee(process: subprocess.Popen, log) -> None:
    out = sys.stdout.buffer
    assert process.stdout is not None
    while chunk := os.read(process.stdout.fileno(), 65536):
        out.write(chunk)
        out.flush()
        log.write(chunk)
        log.flush()


def _shell_exit_code(code: int) -> int:
    """Popen's -N for a signal becomes the shell's 128+N."""
    return 128 - code if code < 0 else code


def _alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
