"""Commands documented in Markdown (the README, docs/, the NeMo launcher's reference), read out of
their code blocks and dry-run in this process."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
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


# Slurm's commands, which a machine without Slurm lacks.
SLURM_COMMANDS = frozenset(
    {"sacct", "sacctmgr", "salloc", "sattach", "sbatch", "sbcast", "scancel", "scontrol"}
    | {"sdiag", "sinfo", "sprio", "squeue", "sreport", "srun", "sshare", "sstat", "strigger"}
)


@functools.cache
def _without_slurm_commands(folder: str) -> str:
    """A folder of links to `folder`'s programs but Slurm's."""
    links = Path(tempfile.mkdtemp(prefix="no-slurm-"))
    atexit.register(shutil.rmtree, links, True)
    for program in Path(folder).iterdir():
        if program.name not in SLURM_COMMANDS:
            (links / program.name).symlink_to(program)
    return str(links)


def without_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dry-run as on a machine without Slurm (no Slurm command on PATH), where a dry run cannot
    ask the cluster about its partitions. The pages' commands are written for the reader's
    cluster: this machine's Slurm is the tests' own, whose default partition has one node, so
    it would refuse a published recipe's node count."""
    folders = os.environ.get("PATH", "").split(os.pathsep)
    kept = [
        _without_slurm_commands(folder) if (Path(folder) / "sinfo").exists() else folder
        for folder in folders
    ]
    monkeypatch.setenv("PATH", os.pathsep.join(kept))
