"""Which checkpoints are complete, and the newest one's step: torch-free, so it is quick.

A checkpoint is complete when its state file is there and every file it lists has the size it
had when the checkpoint was saved (`files`, recorded by the save). A checkpoint one of whose
files is missing or of another size (a copy cut short, a full disk during a sync) is damaged:
resume and conversion never read it, and say so (`damaged_checkpoints`).

    python3 -m launcher_scripts.formats.progress CHECKPOINT_DIR   # the step, or 0

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
    # Every file of the checkpoint (path relative to it) and its size when saved; empty for
    # checkpoints saved before sizes were recorded, which are then trusted as they are.
    files: dict[str, int] = field(default_factory=dict)
    # What the run's task keeps beyond its models (PPO's KL coefficient, the schedules of the
    # models it trains beside the main one), JSON values.
    task: dict[str, Any] = field(default_factory=dict)
    # Early stopping's count (recipes/early_stopping.py): best, best_step, wait, and `stopped`
    # with its reason once it ended the run.
    early_stopping: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    state: TrainState


def saved_checkpoints(directory: Path) -> list[Checkpoint]:
    """Checkpoints whose save finished (a readable state file), oldest step first; torn or
    temporary folders are left out."""
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


def damage(checkpoint: Checkpoint) -> str | None:
    """What is wrong with a saved checkpoint's files, or None when each has its saved size."""
    for name, size in sorted(checkpoint.state.files.items()):
        try:
            actual = (checkpoint.path / name).stat().st_size
        except FileNotFoundError:
            return f"its file {name} is missing"
        if actual != size:
            return f"its file {name} has {actual} bytes, {size} when it was saved"
    return None


def complete_checkpoints(directory: Path) -> list[Checkpoint]:
    """Saved checkpoints whose files are all there whole, oldest step first."""
    return [c for c in saved_checkpoints(directory) if damage(c) is None]


def damaged_checkpoints(directory: Path) -> list[tuple[Checkpoint, str]]:
    """Saved checkpoints with a missing or cut file, and what is wrong, oldest step first."""
    found = []
    for checkpoint in saved_checkpoints(directory):
        problem = damage(checkpoint)
        if problem is not None:
            found.append((checkpoint, problem))
    return found


def newest_step(directory: Path) -> int:
    found = complete_checkpoints(directory)
    return found[-1].state.step if found else 0


if __name__ == "__main__":
    print(newest_step(Path(sys.argv[1])))
