"""What a training or tuning run left in its results folder, as the tests read it."""

from __future__ import annotations

import json
from pathlib import Path


def metric(log_dir: Path, name: str) -> dict[int, float]:
    """Each step's value of `name` in the run's metrics.jsonl."""
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row[name] for row in rows if name in row}


def job_log(log_dir: Path) -> str:
    """The run's job logs (every attempt's, in order), beside its results folder."""
    return "\n".join(path.read_text() for path in sorted(log_dir.parent.glob("log-*.out")))
