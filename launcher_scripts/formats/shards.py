"""Which share of the work this task owns: rank selection and the file_numbers syntax.

Kept free of heavy imports: every data-preparation job program imports it at start-up.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")

# Checked in order: a Slurm array task is the unit of a node array; a multi-process job
# (torchrun, bcprun, srun tasks) splits by its global rank.
_RANK_ENV_PAIRS = (
    ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"),
    ("NGC_ARRAY_INDEX", "NGC_ARRAY_SIZE"),
    ("RANK", "WORLD_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
)
# Every variable that can assign a task its rank, for those that must clear them.
RANK_VARIABLES = tuple(name for pair in _RANK_ENV_PAIRS for name in pair) + ("LOCAL_RANK",)


def parse_file_numbers(spec: str | int) -> list[int]:
    """Parse "0,3,5-7" into [0, 3, 5, 6, 7] (sorted, without repeats).

    Raises ValueError with the offending part when the syntax is wrong.
    """
    text = str(spec).strip()
    if not text:
        raise ValueError("file_numbers is empty: give numbers and ranges such as '0,3,5-7'")
    numbers: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        first, sep, last = part.partition("-")
        try:
            start = int(first)
            end = int(last) if sep else start
        except ValueError:
            raise ValueError(
                f"file_numbers part {part!r} is not a number or a range: use e.g. '0,3,5-7'"
            ) from None
        if start < 0 or end < start:
            raise ValueError(f"file_numbers range {part!r} is empty or negative: use e.g. '5-7'")
        numbers.update(range(start, end + 1))
    return sorted(numbers)


def rank_and_world_size(
    env: Mapping[str, str] | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> tuple[int, int]:
    """This task's rank and the number of tasks sharing the work.

    Explicit values win; otherwise the first scheduler variable pair present in `env`.
    """
    if rank is not None or world_size is not None:
        if rank is None or world_size is None:
            raise ValueError("give both --rank and --world-size, or neither")
        return _checked(rank, world_size)
    env = os.environ if env is None else env
    for rank_key, size_key in _RANK_ENV_PAIRS:
        if rank_key in env and size_key in env:
            return _checked(int(env[rank_key]), int(env[size_key]))
    return 0, 1


def my_file_numbers(
    spec: str | int, rank: int | None = None, world_size: int | None = None
) -> list[int]:
    """This task's share of the file numbers in `spec`, announced on stdout for the log."""
    rank, world_size = rank_and_world_size(rank=rank, world_size=world_size)
    numbers = share(parse_file_numbers(spec), rank, world_size)
    print(f"task {rank} of {world_size}: file numbers {numbers or 'none'}", flush=True)
    return numbers


def _checked(rank: int, world_size: int) -> tuple[int, int]:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size} tasks")
    return rank, world_size


def share(items: Sequence[T], rank: int, world_size: int) -> list[T]:
    """The items task `rank` of `world_size` owns: every world_size-th, starting at rank."""
    return list(items[rank::world_size])


# The splits of a dataset, in the order megatron-core's split string gives their shares.
SPLIT_NAMES = ("train", "validation", "test")
