"""Collective bandwidth as nccl-tests reports it, so the built-in sweep's figures read like
`all_reduce_perf`'s.

algbw is the data size over the time. busbw scales it by the traffic each rank's link carries
in the ring algorithm, which makes it comparable with the link's own speed whatever the rank
count: for all-reduce 2(n-1)/n (nccl-tests' doc/PERFORMANCE.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Each collective's busbw / algbw factor for n ranks (nccl-tests' doc/PERFORMANCE.md).
BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


@dataclass(frozen=True)
class Measurement:
    """One size of a sweep: bytes per rank and the time of one collective, in seconds."""

    size_bytes: int
    seconds: float
    ranks: int
    collective: str = "all_reduce"

    @property
    def algbw_gbps(self) -> float:
        """GB/s (10^9 bytes), as nccl-tests prints it."""
        return self.size_bytes / self.seconds / 1e9

    @property
    def busbw_gbps(self) -> float:
        return self.algbw_gbps * BUS_FACTORS[self.collective](self.ranks)


def peak_busbw(measurements: list[Measurement]) -> float:
    """The sweep's figure for a link: the best busbw over its sizes (the largest sizes reach
    the link's speed; small ones measure latency)."""
    if not measurements:
        raise ValueError("no measurements")
    return max(m.busbw_gbps for m in measurements)


# A result row of nccl-tests' *_perf: size count type redop root time algbw busbw #wrong, out
# of place then in place. The in-place busbw is the last float before its #wrong.
_ROW = re.compile(
    r"^\s*(?P<size>\d+)\s+(?P<count>\d+)\s+\w+\s+\w+\s+-?\d+"
    r"(?:\s+(?P<oop_time>[\d.]+)\s+(?P<oop_algbw>[\d.]+)\s+(?P<oop_busbw>[\d.]+)\s+\S+)"
    r"(?:\s+(?P<ip_time>[\d.]+)\s+(?P<ip_algbw>[\d.]+)\s+(?P<ip_busbw>[\d.]+)\s+\S+)?\s*$"
)


def parse_nccl_tests(output: str) -> dict[int, float]:
    """{size in bytes: out-of-place busbw in GB/s} from an `all_reduce_perf` log."""
    rows = {}
    for line in output.splitlines():
        match = _ROW.match(line)
        if match:
            rows[int(match["size"])] = float(match["oop_busbw"])
    return rows
