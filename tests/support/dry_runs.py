"""Commands documented in Markdown (the README, docs/, the NeMo launcher's reference), read out of
their code blocks and dry-run in this process."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

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
