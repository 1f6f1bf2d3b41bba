"""Commands documented in Markdown (the README, docs/, the NeMo launcher's reference), read out of
their code blocks and dry-run in this process."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest

# What a dry run prints last when every script was rendered and checked.
DRY_RUN_DONE = "nothing was run or submitted"


def continued(lines: Sequence[str], index: int) -> tuple[str, int]:
    """The shell command starting at `lines[index]` with its `\\` line ends joined, and the
    index of its last line."""
    joined = lines[index]
    while joined.rstrip().endswith("\\") and index + 1 < len(lines):
        index += 1
        joined = joined.rstrip()[:-1] + " " + lines[index]
    return joined.strip(), index


def as_dry_run(overrides: Sequence[str], root: Path) -> list[str]:
    """`overrides` as a dry run writing under `root` where they name no results or data
    folder."""
    args = list(overrides)
    if not any(arg.startswith("base_results_dir=") for arg in args):
        args.append(f"base_results_dir={root}/results")
    if not any(arg.startswith("data_dir=") for arg in args):
        args.append(f"data_dir={root}/data")
    return [*args, "dry_run=true"]


def without_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dry-run as on a machine without Slurm (no sinfo on PATH), where a dry run cannot ask
    the cluster about its partitions. The pages' commands are written for the reader's
    cluster: this machine's Slurm is the tests' own, whose default partition has one node, so
    it would refuse a published recipe's node count."""
    folders = os.environ.get("PATH", "").split(os.pathsep)
    kept = [folder for folder in folders if not (Path(folder) / "sinfo").exists()]
    monkeypatch.setenv("PATH", os.pathsep.join(kept))
