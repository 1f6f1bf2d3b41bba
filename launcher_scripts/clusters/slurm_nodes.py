"""The Slurm cluster's nodes and partitions as `sinfo` lists them, for the checks that need no
submission: a job asking for more nodes than its partition has would wait forever (PENDING,
reason PartitionNodeLimit), and an --exclude naming a node Slurm does not know fails sbatch.

Read only where sinfo answers: a dry run on a machine without Slurm (or whose controller does
not answer) knows nothing of the cluster, and these checks are left out there.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: tuple[str, ...]
    max_job_nodes: int | None  # the partition's MaxNodes; None: unlimited


@dataclass(frozen=True)
class SlurmNodes:
    partitions: dict[str, Partition]
    default: str | None  # where a job goes without --partition

    @property
    def known(self) -> frozenset[str]:
        """Every node of the cluster."""
        return frozenset(node for part in self.partitions.values() for node in part.nodes)

    def partition(self, name: str | None) -> Partition | None:
        """The partition `name`, or the default one for None; None when there is no such."""
        return self.partitions.get(name or self.default or "")


@dataclass(frozen=True)
class SinfoAnswer:
    nodes: SlurmNodes | None  # None: no answer
    problem: str | None  # why there is none (None: sinfo is not installed here)


def ask_sinfo() -> SinfoAnswer:
    """The cluster's partitions and nodes, or why sinfo gave none."""
    if shutil.which("sinfo") is None:
        return SinfoAnswer(None, None)
    try:
        # One line per node and partition (-N), hidden partitions too (-a).
        result = subprocess.run(
            ["sinfo", "-h", "-a", "-N", "-o", "%N|%P|%s"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return SinfoAnswer(None, f"sinfo did not answer: {error}")
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        return SinfoAnswer(None, lines[0] if lines else f"exit code {result.returncode}")
    return SinfoAnswer(parse_nodes(result.stdout), None)


def parse_nodes(text: str) -> SlurmNodes:
    """sinfo's "%N|%P|%s" lines: node, partition (the default one marked "*"), the
    partition's job size in nodes ("1-infinite", "1-4", "2+", "8")."""
    nodes: dict[str, list[str]] = {}
    sizes: dict[str, int | None] = {}
    default = None
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 3:
            continue
        node, name, size = fields
        if name.endswith("*"):
            name = default = name[:-1]
        members = nodes.setdefault(name, [])
        if node not in members:
            members.append(node)
        sizes[name] = _largest_job(size)
    partitions = {
        name: Partition(name, tuple(members), sizes[name]) for name, members in nodes.items()
    }
    return SlurmNodes(partitions, default)


def _largest_job(size: str) -> int | None:
    """The upper end of sinfo's job size ("1-infinite" -> None, "1-4" -> 4, "8" -> 8)."""
    upper = size.rpartition("-")[2]
    return int(upper) if upper.isdigit() else None
