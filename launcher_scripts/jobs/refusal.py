"""A job program's refusal (a JobError, ConfigError, ...: its inputs or settings are wrong), said
once for the whole job rather than once by each of its processes.

Under the local backend's torchrun (launcher_scripts.jobs.torchrun), which names a folder in
REFUSALS_VARIABLE, each process leaves its line there and exits; torchrun prints the first
rank's line once, in place of its own failure report.

Elsewhere (srun's tasks, torchrun on BCP or Kubernetes, a single process) rank 0 prints its
line and exits, and the launcher ends the others (srun --kill-on-bad-exit, torchrun). A rank
other than 0 stays quiet while it waits to be ended that way, for up to QUIET_WAIT_SECONDS: a
rank that printed and exited at once could be the first to exit, and rank 0 be ended before
it had printed its own line. A rank still running after the wait (rank 0 did not refuse, or
nothing ends the job's processes) prints its own line then.

Torch-free: a job program refuses before it has imported torch, too.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from launcher_scripts.files import write_atomic
from launcher_scripts.jobs.process import process_info

REFUSALS_VARIABLE = "LAUNCHER_REFUSALS_DIR"
EXIT_REFUSED = 1  # the job programs' exit code for bad inputs, on every rank
QUIET_WAIT_SECONDS = 30
# What ends a waiting rank: the launcher's signals (and Ctrl-C), with their default action.
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


def refusal_file(folder: Path, rank: int) -> Path:
    return folder / f"rank-{rank}.txt"


def refuse(error: BaseException | str) -> int:
    """Say `error` as the job's one line ("error: ..."), once per job; the exit code."""
    line = f"error: {error}\n"
    rank = process_info().rank
    folder = os.environ.get(REFUSALS_VARIABLE)
    if folder:
        try:
            write_atomic(refusal_file(Path(folder), rank), line)
            return EXIT_REFUSED
        except OSError:
            pass  # said below instead
    if rank != 0:
        for signum in ENDING_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        time.sleep(QUIET_WAIT_SECONDS)
    # One write, so that the lines of processes sharing the output do not run into one another.
    sys.stderr.write(line)
    sys.stderr.flush()
    return EXIT_REFUSED


def collected(folder: Path) -> dict[int, str]:
    """The refusals the job's processes left in `folder`, by rank."""
    found = {}
    for path in folder.glob("rank-*.txt"):
        rank = path.stem.removeprefix("rank-")
        if rank.isdigit():
            found[int(rank)] = path.read_text()
    return found
