"""Cluster validation on CI's namespace nodes (`.ci/slurm-up.sh`'s n1..n3), through the
command users run (`csp_tools/<csp>/cluster_validation.sh`): healthy nodes pass and get their
report; a node whose link is rate-limited with `tbf` is named (not its pair); a node whose
diagnostic fails (the fault-injection setting) is listed; bad input is one line. The built-in
sweep measures a pair, and a rendezvous that cannot form ends in one line. A command Slurm
refuses (an unknown partition or node, a bad time limit, GPUs the nodes lack) is a usage error,
never a verdict that drains the nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from csp_tools.validation import run
from csp_tools.validation.allreduce_sweep import ONE_RANK
from csp_tools.validation.preflight import UsageError, check_time_limit, gpu_count
from csp_tools.validation.settings import load
from tests.support import REPO
from tests.support.slurm import MULTI_PARTITION, srun_on_nodes, submit_to_nodes

SCRIPT = REPO / "csp_tools" / "generic" / "cluster_validation.sh"

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
    nodes: list[str], tmp_path: Path, *args: str, site: str = SITE
) -> tuple[subprocess.CompletedProcess, dict]:
    """The generic provider's cluster_validation.sh on `nodes`; its output and verdict.json."""
    settings = tmp_path / "site.yaml"
    settings.write_text(site)
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
def test_when_no_pair_passes_no_node_is_said_to_pass(
    slurm_nodes: list[str], tmp_path: Path
) -> None:
    """Every pair under the floor: no good partner to retest with, so every node is
    unconfirmed. That is a failed validation, not "all nodes passed" with exit 0."""
    nodes = slurm_nodes[:2]
    site = SITE.replace(
        "{straggler_fraction: 0.2", "{min_busbw_gbps: 1000000, straggler_fraction: 0.2"
    )
    assert site != SITE
    result, verdict = validate(nodes, tmp_path, "--nccl", site=site)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "nodes passed" not in result.stdout
    assert "2 of 2 nodes unconfirmed" in result.stdout
    assert verdict["drain"] == {} and verdict["passed"] == []
    assert sorted(verdict["unconfirmed"]) == nodes


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


def cluster_validation(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=600, env=env
    )


def assert_usage_error(result: subprocess.CompletedProcess, message: str, results: Path) -> None:
    """Exit 2, one line saying `message`, and no results folder (so no verdict)."""
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("cluster_validation: ") and message in line, line
    assert not results.exists(), sorted(results.rglob("*"))


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
        (  # a fault for a node not validated would be ignored
            ("--nodes=3", "--nodelist=n[1-3]", "--inject-fault=n11:memory_cpu"),
            "--inject-fault=n11:memory_cpu: n11 is not in --nodelist (did you mean n1?)",
        ),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    slurm: None, tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    results = tmp_path / "validation"
    result = cluster_validation(*args, f"--partition={MULTI_PARTITION}", f"--results-dir={results}")
    assert_usage_error(result, message, results)


# Commands srun refuses before any task runs; each fails on every node it names, so counted as
# node failures it would drain healthy nodes.
REFUSED = [
    pytest.param(
        ("--nodes=8", "--nodelist=node-[0-7]", f"--partition={MULTI_PARTITION}"),
        f"node-0,node-1,node-2,node-3,node-4,node-5,node-6,node-7 are not in partition "
        f"{MULTI_PARTITION}",
        "Invalid node name specified",
        id="unknown-nodes",
    ),
    pytest.param(
        ("--nodes=2", "--nodelist=n[1-2]", "--partition=gpu"),
        "--partition=gpu: no such partition",
        "Invalid partition name specified",
        id="unknown-partition",
    ),
    pytest.param(
        ("--nodes=2", "--nodelist=n[1-2]", f"--partition={MULTI_PARTITION}", "--time-limit=abc"),
        "--time-limit=abc: not a Slurm time limit",
        "Invalid --time specification",
        id="bad-time-limit",
    ),
    pytest.param(
        ("--nodes=2", "--nodelist=n[1-2]", f"--partition={MULTI_PARTITION}", "--gpus-per-node=8"),
        "--gpus-per-node=8: Slurm's GRES of n1,n2 is (null), without 8 GPUs",
        "Invalid generic resource (gres) specification",
        id="gpus-without-gres",
    ),
    pytest.param(
        ("--nodes=2", "--nodelist=vm,n1", f"--partition={MULTI_PARTITION}"),
        f"vm is not in partition {MULTI_PARTITION}",
        "Requested node configuration is not available",
        id="node-of-another-partition",
    ),
]


@pytest.mark.parametrize("stage", ["--dcgm", "--nccl"])
@pytest.mark.parametrize(("args", "message", "refusal"), REFUSED)
def test_a_command_slurm_refuses_is_one_line_and_no_verdict(
    slurm_nodes: list[str],
    tmp_path: Path,
    stage: str,
    args: tuple[str, ...],
    message: str,
    refusal: str,
) -> None:
    results = tmp_path / "validation"
    assert_usage_error(
        cluster_validation(*args, stage, f"--results-dir={results}"), message, results
    )


# The same refusals as the steps' own srun meets them: each step's shape with one bad option.
STEP_REFUSED = [
    pytest.param({"partition": "gpu"}, None, "Invalid partition name", id="unknown-partition"),
    pytest.param({"time_limit": "abc"}, None, "Invalid --time specification", id="bad-time"),
    pytest.param({"gpus_per_node": 8}, None, "Invalid generic resource", id="gpus-without-gres"),
    pytest.param({}, ["node-0", "node-1"], "Invalid node name specified", id="unknown-nodes"),
    pytest.param(
        {}, ["vm", "n1"], "Requested node configuration is not available", id="other-partition"
    ),
]


@pytest.mark.parametrize("stage", ["--dcgm", "--nccl"])
@pytest.mark.parametrize(("bad", "nodes", "refusal"), STEP_REFUSED)
def test_a_step_srun_cannot_start_judges_no_node(
    slurm_nodes: list[str],
    tmp_path: Path,
    stage: str,
    bad: dict[str, object],
    nodes: list[str] | None,
    refusal: str,
) -> None:
    """Past the checks made before the steps (as a refusal they do not foresee would be), the
    steps' own srun is refused: the run stops with srun's reason, judging no node and writing
    nothing."""
    nodes = nodes or slurm_nodes[:2]
    results = tmp_path / "validation"
    args = run.parse(
        ["--nodes=2", f"--nodelist={','.join(nodes)}", f"--partition={MULTI_PARTITION}", stage]
    )
    vars(args).update(bad)
    with pytest.raises(run.UsageError) as refused:
        run.validate(args, load("generic"), nodes, results)
    assert str(refused.value).startswith("srun could not start a step on ")
    assert refusal in str(refused.value)
    assert not results.exists(), sorted(results.rglob("*"))


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


def test_without_slurms_commands_it_is_one_line(tmp_path: Path) -> None:
    """On a machine without Slurm (srun, sinfo, scontrol not on PATH): no traceback."""
    results = tmp_path / "validation"
    result = subprocess.run(
        [sys.executable, "-m", "csp_tools.validation", "--nodes=2", "--nodelist=n[1-2]"]
        + [f"--partition={MULTI_PARTITION}", f"--results-dir={results}"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PATH": str(tmp_path)},
        timeout=120,
    )
    assert_usage_error(result, "Slurm's srun, sinfo, scontrol are not on PATH", results)


@pytest.mark.parametrize("where", ["file", "under-a-file"])
def test_a_results_dir_that_cannot_be_written_is_one_line_before_any_step(
    tmp_path: Path, where: str
) -> None:
    taken = tmp_path / "taken"
    taken.write_text("a file, not a folder\n")
    results = taken if where == "file" else taken / "validation"
    result = cluster_validation(
        "--nodes=2",
        "--nodelist=n[1-2]",
        f"--partition={MULTI_PARTITION}",
        f"--results-dir={results}",
    )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout == ""  # no step ran
    (line,) = result.stderr.strip().splitlines()
    assert line == (
        f"cluster_validation: --results-dir={results}: {taken} is not a folder; give a folder "
        "to write the results in"
    )
    assert taken.read_text() == "a file, not a folder\n"


@pytest.mark.parametrize(
    ("site", "message"),
    [
        (
            "interconnect: {pair_flor_gbps: 5}",
            "interconnect.pair_flor_gbps is not a setting; the interconnect keys are "
            "min_busbw_gbps, straggler_fraction, min_bytes, max_bytes",
        ),
        (
            "node: {stragler_fraction: 0.1}",
            "node.stragler_fraction is not a setting; did you mean node.straggler_fraction?",
        ),
        (
            "node: {min_busbw_gbps: 5}",
            "node.min_busbw_gbps is not a setting; did you mean interconnect.min_busbw_gbps?",
        ),
        (
            "interconect: {min_bytes: 1M}",
            "interconect is not a setting; did you mean interconnect?",
        ),
    ],
)
def test_a_mistyped_settings_key_is_refused_with_a_suggestion(
    tmp_path: Path, site: str, message: str
) -> None:
    """A key no setting has would leave its default in force without a word: the command and
    the job scripts' settings reader refuse it."""
    settings = tmp_path / "site.yaml"
    settings.write_text(site + "\n")
    results = tmp_path / "validation"
    result = cluster_validation(
        "--nodes=2",
        "--nodelist=n[1-2]",
        f"--partition={MULTI_PARTITION}",
        f"--settings={settings}",
        f"--results-dir={results}",
    )
    assert_usage_error(result, f"{settings}: {message}", results)
    exports = subprocess.run(
        [sys.executable, "-m", "csp_tools.validation.settings", f"--settings={settings}"]
        + ["--exports"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert exports.returncode == 2 and exports.stdout == ""
    assert exports.stderr.strip() == f"settings: {settings}: {message}"


def test_one_rank_is_refused_not_measured(slurm_nodes: list[str], tmp_path: Path) -> None:
    """An all-reduce of one rank reads busbw 0: nccl.sh as a job on one node, and the sweep
    under srun on one node, refuse it in one line."""
    log = tmp_path / "nccl.log"
    job = subprocess.run(
        [
            *("sbatch", "--wait", "--quiet", f"--partition={MULTI_PARTITION}"),
            *(f"--nodelist={slurm_nodes[0]}", "--ntasks-per-node=1", f"--output={log}"),
            "--export=ALL,MIN_BYTES=64K,MAX_BYTES=64K",
            str(REPO / "csp_tools" / "generic" / "nccl.sh"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert job.returncode == 2, log.read_text() if log.exists() else job.stderr
    (line,) = log.read_text().strip().splitlines()
    assert line.startswith("nccl.sh: 1 rank: an all-reduce measures links between 2 ranks")

    alone = sweep((slurm_nodes[0],), *SWEEP)
    assert alone.returncode == 2 and alone.stdout == ""
    lines = [x for x in alone.stderr.splitlines() if not x.startswith("srun: ")]
    assert lines == [f"allreduce_sweep: {ONE_RANK}"]


@pytest.mark.parametrize(
    "limit", ["30", "30:00", "1:30:00", "2-0", "2-12:00", "2-12:00:00", "UNLIMITED", "infinite"]
)
def test_slurms_time_limit_forms_are_taken(limit: str) -> None:
    check_time_limit(limit)


@pytest.mark.parametrize("limit", ["abc", "30m", "1:2:3:4", "-5", "1-", ""])
def test_other_time_limits_are_refused(limit: str) -> None:
    with pytest.raises(UsageError, match=f"--time-limit={limit}: not a Slurm time limit"):
        check_time_limit(limit)


@pytest.mark.parametrize(
    ("gres", "gpus"),
    [("(null)", 0), ("gpu:8", 8), ("gpu:h100:8(S:0-1)", 8), ("gpu:a100:4,gpu:v100:4", 8)]
    + [("gpu:h100:4(S:0),nic:2", 4)],
)
def test_the_gpus_of_sinfos_gres(gres: str, gpus: int) -> None:
    assert gpu_count(gres) == gpus
