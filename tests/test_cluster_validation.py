"""Cluster validation on CI's namespace nodes (`.ci/slurm-up.sh`'s n1..n3): the built-in
all-reduce sweep measures each pair through Slurm, a link rate-limited with `tbf` makes its
node the one the screening names, and a rendezvous that cannot form ends in one line."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from csp_tools.validation.bandwidth import Measurement, peak_busbw
from csp_tools.validation.screening import (
    Limits,
    PairResult,
    disjoint_pairs,
    known_good,
    retest_pairs,
    screen,
)
from tests.conftest import MULTI_PARTITION, REPO

SWEEP = ("--min-bytes", "64K", "--max-bytes", "256K", "--iters", "3", "--warmup", "1")


def sweep(pair: tuple[str, ...], *args: str, env: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            *("srun", "-p", MULTI_PARTITION, f"--nodelist={','.join(pair)}"),
            *(f"--nodes={len(pair)}", "--ntasks-per-node=1", f"--chdir={REPO}"),
            "--export=ALL" + env,
            *("python3", "-m", "csp_tools.validation.allreduce_sweep", *args),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )


def measure(pair: tuple[str, str]) -> PairResult:
    result = sweep(pair, *SWEEP)
    if result.returncode != 0:
        return PairResult(pair, None, result.stderr.strip().splitlines()[-1])
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert {tuple(sorted(r["hosts"])) for r in records} == {tuple(sorted(pair))}, records
    measurements = [Measurement(r["size_bytes"], r["seconds"], r["ranks"]) for r in records]
    return PairResult(pair, peak_busbw(measurements))


@contextmanager
def slow_link(node: str, rate: str = "8mbit") -> Iterator[None]:
    """The node's link (the bridge side of its veth) limited to `rate` by a tbf qdisc."""
    device = f"veth-{node}"
    shape = ("tbf", "rate", rate, "burst", "32kbit", "latency", "400ms")
    subprocess.run(["tc", "qdisc", "replace", "dev", device, "root", *shape], check=True)
    try:
        yield
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", device, "root"], check=True)


def test_the_sweep_measures_a_pair_of_nodes(slurm_nodes: list[str]) -> None:
    result = sweep(tuple(slurm_nodes[:2]), *SWEEP)
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["size_bytes"] for r in records] == [2**16, 2**18]
    for record in records:
        assert record["hosts"] == slurm_nodes[:2] and record["ranks"] == 2
        assert record["busbw_gbps"] == record["algbw_gbps"] > 0  # 2 ranks: factor 1


def test_a_rate_limited_node_is_named_by_the_screening(slurm_nodes: list[str]) -> None:
    """n2's link at 8 Mbit/s (about 100 times slower than the others here): its pair fails as
    a straggler against the median pair, and the retests with known-good nodes put it on n2,
    not on its partner. The fraction is low so that a busy machine's slower healthy pairs pass."""
    nodes = slurm_nodes[:3]
    slow = nodes[1]
    limits = Limits(min_busbw_gbps=0.0, straggler_fraction=0.2)
    with slow_link(slow):
        first = [measure(pair) for pair in disjoint_pairs(nodes)]
        good = known_good(nodes, first, limits)
        assert good == [nodes[2]], first
        retests = [measure(pair) for pair in retest_pairs([p.nodes for p in first], good)]
    verdict = screen(nodes, first, retests, limits)
    assert list(verdict.bad) == [slow], (first, retests)
    assert "straggler" in verdict.bad[slow]
    assert verdict.unconfirmed == {} and verdict.good == [nodes[0], nodes[2]]


def test_a_rendezvous_that_cannot_form_is_one_line(slurm_nodes: list[str]) -> None:
    """The ranks are sent to meet on a node outside the job: nothing listens there."""
    pair = tuple(slurm_nodes[:2])
    result = sweep(pair, "--timeout", "5", env=f",MASTER_ADDR={slurm_nodes[2]},MASTER_PORT=29599")
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("allreduce_sweep:")]
    assert lines and all(f"at {slurm_nodes[2]}:29599 within 5 s" in line for line in lines), (
        result.stderr[-3000:]
    )


def probe(node: str, env: str = "") -> dict:
    result = subprocess.run(
        [
            *("srun", "-p", MULTI_PARTITION, f"--nodelist={node}", "--ntasks=1"),
            f"--chdir={REPO}",
            "--export=ALL" + env,
            *("python3", "-m", "csp_tools.validation.node_probe", "--cpu-copy-megabytes", "16"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(result.stdout.splitlines()[-1])
    assert result.returncode == (0 if report["passed"] else 1), result.stderr[-2000:]
    return report


def test_a_node_whose_diagnostic_fails_is_the_one_listed(slurm_nodes: list[str]) -> None:
    """The fault-injection setting makes n3's memory check fail; each report names its node."""
    faulty = slurm_nodes[2]
    reports = {
        node: probe(node, ",CSP_VALIDATION_INJECT_FAULT=memory_cpu" if node == faulty else "")
        for node in slurm_nodes[:3]
    }
    assert {node: r["node"] for node, r in reports.items()} == {n: n for n in slurm_nodes[:3]}
    assert [node for node, r in reports.items() if not r["passed"]] == [faulty]
    failed = [c for c in reports[faulty]["checks"] if c["status"] == "fail"]
    assert [c["name"] for c in failed] == ["memory_cpu"]
    assert all(c["value"] > 0 for r in reports.values() for c in r["checks"])
