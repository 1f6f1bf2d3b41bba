"""Which nodes to drain, from a pairwise interconnect sweep.

The sweep measures disjoint pairs of nodes, every node in one pair per round. A pair that fails
(it did not run, its busbw is under the absolute threshold, or it is a straggler: under a
fraction of the median of all pairs) names two suspects, not a bad node. Each suspect is then
measured again with a node whose own pair passed: a suspect whose retest fails too is a bad node,
one whose retest passes was the good half of its pair. A suspect that cannot be retested (no
node passed) is listed as unconfirmed, so the report never blames a node on guesswork.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

Pair = tuple[str, str]


@dataclass(frozen=True)
class PairResult:
    """One pair's figure: its peak busbw in GB/s, or None with the error when it did not run."""

    nodes: Pair
    busbw_gbps: float | None
    error: str | None = None


@dataclass(frozen=True)
class Limits:
    min_busbw_gbps: float  # absolute: the CSP's link, less a margin
    straggler_fraction: float  # a pair under this fraction of the median pair fails

    def __post_init__(self) -> None:
        if self.min_busbw_gbps < 0:
            raise ValueError("min_busbw_gbps must be 0 or more")
        if not 0 <= self.straggler_fraction <= 1:
            raise ValueError("straggler_fraction must be between 0 and 1")


def disjoint_pairs(nodes: Sequence[str]) -> list[Pair]:
    """Nodes two by two, in order. An odd node out is paired with the first node, which is
    then measured twice, so every node is in at least one pair."""
    if len(nodes) < 2:
        raise ValueError(f"a pairwise sweep needs 2 nodes or more, got {len(nodes)}")
    if len(set(nodes)) != len(nodes):
        raise ValueError(f"a node is listed twice: {sorted(nodes)}")
    pairs = [(nodes[i], nodes[i + 1]) for i in range(0, len(nodes) - 1, 2)]
    if len(nodes) % 2:
        pairs.append((nodes[-1], nodes[0]))
    return pairs


def failure(result: PairResult, median: float | None, limits: Limits) -> str | None:
    """Why the pair fails, in words, or None when it passes."""
    if result.busbw_gbps is None:
        return f"did not run: {result.error or 'no result'}"
    if result.busbw_gbps < limits.min_busbw_gbps:
        return f"busbw {result.busbw_gbps:.3g} GB/s < threshold {limits.min_busbw_gbps:.3g}"
    floor = None if median is None else limits.straggler_fraction * median
    if floor is not None and result.busbw_gbps < floor:
        return (
            f"straggler: busbw {result.busbw_gbps:.3g} GB/s < {limits.straggler_fraction:g} x "
            f"median {median:.3g}"
        )
    return None


def median_busbw(results: Sequence[PairResult]) -> float | None:
    measured = [r.busbw_gbps for r in results if r.busbw_gbps is not None]
    return statistics.median(measured) if measured else None


def failures(results: Sequence[PairResult], limits: Limits) -> dict[Pair, str]:
    """Each failing pair and why, against the median of these results."""
    median = median_busbw(results)
    found = {r.nodes: failure(r, median, limits) for r in results}
    return {pair: why for pair, why in found.items() if why is not None}


def retest_pairs(failing: Sequence[Pair], good: Sequence[str]) -> list[Pair]:
    """Each suspect of the failing pairs with a known-good node, spread over the good nodes
    in turn. Empty when no node is known good."""
    if not good:
        return []
    suspects = sorted({node for pair in failing for node in pair} - set(good))
    return [(suspect, good[i % len(good)]) for i, suspect in enumerate(suspects)]


@dataclass(frozen=True)
class Verdict:
    bad: dict[str, str]  # node -> why: drain it
    unconfirmed: dict[str, str]  # node -> why: in a failing pair, not retested
    good: list[str]


def screen(
    nodes: Sequence[str],
    first_round: Sequence[PairResult],
    retests: Sequence[PairResult],
    limits: Limits,
) -> Verdict:
    """The verdict on every node from the first round and the retests of its suspects.

    A retest is judged against the first round's median: one slow suspect retested alone
    cannot make itself the median.
    """
    failing = failures(first_round, limits)
    suspects = {node for pair in failing for node in pair}
    median = median_busbw(first_round)
    retested: dict[str, str | None] = {}
    for result in retests:
        suspect = next((n for n in result.nodes if n in suspects), None)
        if suspect is not None:
            why = failure(result, median, limits)
            # Failing once with a good partner is enough; a pass does not undo a failure.
            if retested.get(suspect) is None:
                retested[suspect] = why
    bad, unconfirmed = {}, {}
    for node in sorted(suspects):
        first = "; ".join(
            f"with {_other(pair, node)}: {failing[pair]}" for pair in failing if node in pair
        )
        if node not in retested:
            unconfirmed[node] = f"{first}; not retested (no node passed)"
        elif retested[node] is not None:
            bad[node] = f"{first}; retest: {retested[node]}"
    good = [n for n in nodes if n not in bad and n not in unconfirmed]
    return Verdict(bad=bad, unconfirmed=unconfirmed, good=good)


def known_good(
    nodes: Sequence[str], first_round: Sequence[PairResult], limits: Limits
) -> list[str]:
    """The nodes of the first round that were in no failing pair: the retests' partners."""
    suspects = {node for pair in failures(first_round, limits) for node in pair}
    return [n for n in nodes if n not in suspects]


def _other(pair: Pair, node: str) -> str:
    return pair[1] if pair[0] == node else pair[0]
