"""Cluster validation on CI's namespace nodes (`.ci/slurm-up.sh`'s n1..n3), through the
command users run (`csp_tools/<csp>/cluster_validation.sh`): healthy nodes pass and get their
report; a node whose link is rate-limited with `tbf` is named (not its pair); a node whose
diagnostic fails (the fault-injection setting) is listed; bad input is one line. The built-in
sweep measures a pair, and a rendezvous that cannot form ends in one line."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.slurm import MULTI_PARTITION, srun_on_nodes, submit_to_nodes

SWEEP = ("--min-bytes", "64K", "--max-bytes", "256K", "--iters", "3", "--warmup", "1")


def sweep(pair: tuple[str, ...], *args: str, env: str = "") -> subprocess.CompletedProcess:
    module = ("python3", "-m", "csp_tools.validation.allreduce_sweep")
    return srun_on_nodes(pair, *module, *args, env=env)


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


@pytest.mark.slow
def test_the_sweep_measures_a_pair_of_nodes(slurm_nodes: list[str]) -> None:
    result = sweep(tuple(slurm_nodes[:2]), *SWEEP)
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["size_bytes"] for r in records] == [2**16, 2**18]
    for record in records:
        assert record["hosts"] == slurm_nodes[:2] and record["ranks"] == 2
        assert record["busbw_gbps"] == record["algbw_gbps"] > 0  # 2 ranks: factor 1


@pytest.mark.slow
def test_a_rendezvous_that_cannot_form_is_one_line(slurm_nodes: list[str]) -> None:
    """The ranks are sent to meet on a node outside the job: nothing listens there."""
    pair = tuple(slurm_nodes[:2])
    result = sweep(pair, "--timeout", "5", env=f",MASTER_ADDR={slurm_nodes[2]},MASTER_PORT=29599")
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("allreduce_sweep:")]
    assert lines and all(f"at {slurm_nodes[2]}:29599 within 5 s" in line for line in lines), (
        result.stderr[-3000:]
    )


# Small sizes (a link slowed to 8 Mbit/s still ends in seconds); no cluster-wide comparison of
# the CPU figures (the probes share this machine's two cores); a pair fails under 0.2 x the
# median pair (here a slowed link is about 100 times slower, and a busy machine's healthy pairs
# stay well above it).
SITE = """
interconnect: {straggler_fraction: 0.2, min_bytes: 64K, max_bytes: 256K}
node: {straggler_fraction: 0}
"""


def validate(
    nodes: list[str], tmp_path: Path, *args: str
) -> tuple[subprocess.CompletedProcess, dict]:
    """The generic provider's cluster_validation.sh on `nodes`; its output and verdict.json."""
    settings = tmp_path / "site.yaml"
    settings.write_text(SITE)
    result = subprocess.run(
        [
            *("bash", str(REPO / "csp_tools" / "generic" / "cluster_validation.sh")),
            *(f"--nodes={len(nodes)}", f"--nodelist={','.join(nodes)}"),
            *(f"--partition={MULTI_PARTITION}", f"--settings={settings}"),
            f"--results-dir={tmp_path / 'validation'}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    runs = sorted((tmp_path / "validation").glob("*/verdict.json"))
    verdict = json.loads(runs[-1].read_text()) if runs else {}
    return result, verdict


@pytest.mark.slow
def test_healthy_nodes_pass_and_get_their_report(slurm_nodes: list[str], tmp_path: Path) -> None:
    nodes = slurm_nodes[:3]
    result, verdict = validate(nodes, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "all 3 nodes passed" in result.stdout
    assert verdict["drain"] == {} and verdict["passed"] == nodes
    (run,) = (tmp_path / "validation").iterdir()
    for name in ("nodes.md", "nodes.json", "pairs.md", "pairs.json"):
        assert (run / name).stat().st_size > 0, name
    assert (run / "pairs.png").read_bytes().startswith(b"\x89PNG")
    pairs = json.loads((run / "pairs.json").read_text())
    assert [p["nodes"] for p in pairs] == [nodes[:2], [nodes[2], nodes[0]]]
    assert all(p["busbw_gbps"] > 0 for p in pairs)
    for node in nodes:
        assert f"| {node} | pass |" in (run / "nodes.md").read_text()


@pytest.mark.slow
def test_a_rate_limited_node_is_named_not_its_pair(slurm_nodes: list[str], tmp_path: Path) -> None:
    nodes = slurm_nodes[:3]
    slow = nodes[1]
    with slow_link(slow):
        result, verdict = validate(nodes, tmp_path, "--nccl")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert list(verdict["drain"]) == [slow], verdict
    assert "interconnect:" in verdict["drain"][slow] and "straggler" in verdict["drain"][slow]
    assert f"nodes to drain (1 of 3): {slow}" in result.stdout


@pytest.mark.slow
def test_a_node_whose_diagnostic_fails_is_listed_and_kept_out_of_jobs(
    slurm_nodes: list[str], prepared: Path, tmp_path: Path
) -> None:
    nodes = slurm_nodes[:3]
    faulty = nodes[2]
    result, verdict = validate(nodes, tmp_path, "--dcgm", f"--inject-fault={faulty}:memory_cpu")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert list(verdict["drain"]) == [faulty]
    assert verdict["drain"][faulty].startswith("memory_cpu: injected fault")
    assert verdict["passed"] == nodes[:2]

    # The next launch with exclude_unhealthy: the job Slurm holds excludes the drained node.
    job_id = submit_to_nodes(
        tmp_path / "results",
        f"data_dir={prepared}/data",
        "cluster.exclude_unhealthy=true",
        f"cluster.validation_results={tmp_path / 'validation'}",
    )
    try:
        shown = subprocess.run(
            ["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True
        ).stdout
    finally:
        subprocess.run(["scancel", job_id], check=True)
    assert f"ExcNodeList={faulty}" in shown, shown


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--nodes=2", "--nodelist=n[1-3]"), "--nodes=2 but --nodelist=n[1-3] names 3 nodes"),
        (("--nodes=3", "--nodelist=n[1-3]", "--csp=nope"), "--csp=nope: no such provider"),
        (("--nodes=1", "--nodelist=n1"), "the interconnect sweep needs 2 nodes or more"),
        (
            ("--nodes=3", "--nodelist=n[1-3]", "--inject-fault=n1"),
            "--inject-fault=n1: give NODE:CHECK",
        ),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    slurm: None, tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    result = subprocess.run(
        [
            *("bash", str(REPO / "csp_tools" / "generic" / "cluster_validation.sh")),
            *args,
            f"--partition={MULTI_PARTITION}",
            f"--results-dir={tmp_path / 'validation'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("cluster_validation: ") and message in line
    assert not (tmp_path / "validation").exists()


@pytest.mark.slow
def test_the_manual_job_scripts_run_each_step_by_hand(
    slurm_nodes: list[str], tmp_path: Path
) -> None:
    """A provider's dcgmi_diag.sh and nccl.sh (links to the generic ones) as sbatch runs them:
    one probe report per node; the built-in sweep's busbw per size across the two nodes."""
    pair = slurm_nodes[:2]
    folder = REPO / "csp_tools" / "aws"
    reports = {}
    for script, env in (("dcgmi_diag.sh", "GPUS_PER_NODE=0"), ("nccl.sh", "MAX_BYTES=256K")):
        log = tmp_path / f"{script}.log"
        result = subprocess.run(
            [
                *("sbatch", "--wait", "--quiet", f"--partition={MULTI_PARTITION}"),
                *(f"--nodelist={','.join(pair)}", "--ntasks-per-node=1", f"--output={log}"),
                *(f"--export=ALL,{env},MIN_BYTES=64K", str(folder / script)),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr + (log.read_text() if log.exists() else "")
        reports[script] = [json.loads(x) for x in log.read_text().splitlines() if x[:1] == "{"]
    assert sorted(r["node"] for r in reports["dcgmi_diag.sh"]) == pair
    assert all(r["passed"] for r in reports["dcgmi_diag.sh"])
    sweep = reports["nccl.sh"]
    assert [r["size_bytes"] for r in sweep] == [2**16, 2**18]
    assert all(r["hosts"] == pair and r["busbw_gbps"] > 0 for r in sweep), sweep
