"""torchrun for the local backend's jobs of several processes: `python -m
launcher_scripts.jobs.torchrun ARGS` is `python -m torch.distributed.run ARGS` (the same
options, signals and exit codes), except when the job's program refuses its inputs.

A refusing process leaves its one line in a folder this names (launcher_scripts.jobs.refusal)
and exits. torchrun would then report each process's exit in log lines and end with its
ChildFailedError traceback, some 35 lines after the one that matters; here the first rank's
line is printed once instead, with the programs' exit code for a refusal. A process that
failed otherwise (a crash, with its own traceback) still gets torchrun's whole report.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
import tempfile
from pathlib import Path

from launcher_scripts.jobs.refusal import EXIT_REFUSED, REFUSALS_VARIABLE, collected

# Where torchrun logs the ends of its processes ("failed (exitcode: 1) ...", "Sending process
# ... closing signal SIGTERM").
PROCESS_LOGGERS = ("torch.distributed.elastic.multiprocessing.api",)


class _QuietAfterRefusal(logging.Filter):
    """Drops torchrun's reports of its processes' ends once one has refused: they follow from
    the refusal, which says what to change."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    def filter(self, record: logging.LogRecord) -> bool:
        return not collected(self.folder)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with tempfile.TemporaryDirectory(prefix="launcher-refusals-") as name:
        folder = Path(name)
        os.environ[REFUSALS_VARIABLE] = name  # the processes torchrun starts inherit it
        quiet = _QuietAfterRefusal(folder)
        for logger in PROCESS_LOGGERS:
            logging.getLogger(logger).addFilter(quiet)
        try:
            if argv is not None:
                sys.argv[1:] = argv
            # Run as `python -m torch.distributed.run` runs it (its log lines look the same).
            runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
        except ChildFailedError as failure:
            refusals = collected(folder)
            # A process that exited with an error of its own (not a refusal) is reported as
            # torchrun does; those torchrun ended after the first exit have negative codes.
            unexplained = [
                rank
                for rank, ended in failure.failures.items()
                if ended.exitcode > 0 and rank not in refusals
            ]
            if not refusals or unexplained:
                raise
            sys.stderr.write(refusals[min(refusals)])
            sys.stderr.flush()
            return EXIT_REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main())
