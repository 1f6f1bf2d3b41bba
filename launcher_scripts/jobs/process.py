"""Who this process is among the job's processes (torchrun's or Slurm's variables).

Torch-free, so a wrapper that runs before the job's program (launcher_scripts.jobs.numa_binding)
reads the same identity the program does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessInfo:
    rank: int
    world_size: int
    local_rank: int
    launcher: str  # torchrun | slurm | single


def process_info(environ: Mapping[str, str] | None = None) -> ProcessInfo:
    """torchrun's variables first; else Slurm's, so `srun python -m ...` works without torchrun."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return ProcessInfo(
            int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun"
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return ProcessInfo(
            int(env["SLURM_PROCID"]),
            int(env["SLURM_NTASKS"]),
            int(env.get("SLURM_LOCALID", 0)),
            "slurm",
        )
    return ProcessInfo(0, 1, 0, "single")
