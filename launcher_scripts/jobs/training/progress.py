"""Which checkpoints are complete, and the newest one's step: torch-free, so it is quick.

    python3 -m launcher_scripts.jobs.training.progress CHECKPOINT_DIR   # the step, or 0

The Slurm script runs this before and after a training attempt to decide whether a requeue
would make progress.
"""

from __future__ import annotations

import json
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The exit code of a run stopped by SIGTERM/SIGUSR1 after saving a checkpoint (EX_TEMPFAIL):
# "try again", which a scheduler can requeue on; the same command resumes.
EXIT_PREEMPTED = 75
# The signals that ask a training job to checkpoint and stop: SIGTERM (cancel, Kubernetes),
# SIGUSR1 (Slurm, before the time limit or on preemption).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STATE_FILE = "train_state.json"
TMP_PREFIX = ".tmp-"


@dataclass
class TrainState:
    step: int = 0
    consumed_samples: int = 0
    scheduler: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    world: dict[str, int] = field(default_factory=dict)  # the layout that saved the RNG states


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    state: TrainState


def complete_checkpoints(directory: Path) -> list[Checkpoint]:
    """Finished checkpoints, oldest step first; torn or temporary folders are left out."""
    found = []
    if not directory.is_dir():
        return found
    for path in directory.iterdir():
        state_file = path / STATE_FILE
        if path.name.startswith(TMP_PREFIX) or not state_file.is_file():
            continue
        try:
            raw = json.loads(state_file.read_text())
            found.append(Checkpoint(path, TrainState(**raw)))
        except (ValueError, TypeError):
            continue  # a damaged state file: not a checkpoint to trust
    return sorted(found, key=lambda c: c.state.step)


def newest_step(directory: Path) -> int:
    found = complete_checkpoints(directory)
    return found[-1].state.step if found else 0


if __name__ == "__main__":
    print(newest_step(Path(sys.argv[1])))
