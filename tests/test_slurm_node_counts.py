"""Node counts checked against this machine's Slurm before anything is submitted, in dry runs
too (`.ci/slurm-up.sh`: partition batch, the default, is this one node; multi is the three
namespace nodes). A job asking for more nodes than its partition has would stay PENDING forever
(PartitionNodeLimit); an --exclude naming a node Slurm does not know fails sbatch, and one that
leaves too few nodes of the partition fails it or leaves the job pending.

Without Slurm these tests skip on a developer machine and fail in CI (CI=true), except the one
that dry-runs as on a machine without Slurm.
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from tests.support.commands import assert_one_line_error, run_main
from tests.support.dry_runs import DRY_RUN_DONE, without_slurm
from tests.support.slurm import MULTI_PARTITION, SMALL_CLUSTER

# Each stage that takes a node count, asking for `nodes` nodes of one device each (batch sizes
# every data-parallel size up to 4 divides).
NODE_STAGES = {
    "training": ("training.model.global_batch_size=48",),
    "fine_tuning": (),
    "peft": (),
    "prompt_learning": (),
    "adapter_learning": (),
    "ia3_learning": (),
}


def asking(stage: str, nodes: int) -> tuple[str, ...]:
    return (
        f"stages=[{stage}]",
        f"{stage}.trainer.num_nodes={nodes}",
        f"{stage}.trainer.devices=1",
        *NODE_STAGES[stage],
    )


def launch(tmp_path: Path, *overrides: str, dry_run: bool = True) -> subprocess.CompletedProcess:
    return run_main(
        f"base_results_dir={tmp_path / 'results'}",
        f"data_dir={tmp_path / 'data'}",
        *SMALL_CLUSTER,
        *overrides,
        f"dry_run={str(dry_run).lower()}",
    )


@pytest.mark.parametrize("stage", sorted(NODE_STAGES))
@pytest.mark.parametrize(
    ("partition", "nodes", "has"),
    [(MULTI_PARTITION, 4, "partition multi has 3 ("), (None, 2, "partition batch has 1 (")],
    ids=["multi", "default-partition"],
)
def test_more_nodes_than_the_partition_has_is_refused_in_the_dry_run(
    slurm: None, tmp_path: Path, stage: str, partition: str | None, nodes: int, has: str
) -> None:
    chosen = (f"cluster.partition={partition}",) if partition else ()
    result = launch(tmp_path, *asking(stage, nodes), *chosen)
    assert_one_line_error(
        result,
        f"error: {stage}.trainer.num_nodes: job ",
        f" asks for {nodes} nodes but {has}",
        "PartitionNodeLimit",
        f"Set {stage}.trainer.num_nodes=",
        "cluster.partition",
    )
    assert not (tmp_path / "results").exists()


def test_more_nodes_than_the_partition_has_is_not_submitted(slurm: None, tmp_path: Path) -> None:
    """The real run: refused before any file is written or any job submitted (it used to be
    submitted and stay PENDING, reason PartitionNodeLimit)."""
    prefix = f"node-count-{uuid.uuid4().hex[:8]}:"
    result = launch(
        tmp_path,
        "stages=[data_preparation,training]",
        f"cluster.partition={MULTI_PARTITION}",
        "training.trainer.num_nodes=4",
        "training.model.global_batch_size=48",
        f"cluster.job_name_prefix={prefix}",
        dry_run=False,
    )
    queue = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True)
    submitted = [line.split()[0] for line in queue.stdout.splitlines() if prefix in line]
    if submitted:  # a pending job would wait forever: end it, then fail
        subprocess.run(["scancel", *submitted], check=True)
    assert submitted == []
    assert_one_line_error(result, "training.trainer.num_nodes: job gpt3_tiny asks for 4 nodes")
    assert not (tmp_path / "results").exists()


def test_a_dry_run_without_slurm_leaves_the_node_counts_unchecked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No sinfo here (a laptop rendering a cluster's scripts): nothing to ask, nothing said."""
    without_slurm(monkeypatch)
    result = launch(tmp_path, *asking("training", 4), f"cluster.partition={MULTI_PARTITION}")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert DRY_RUN_DONE in result.stdout


# ----- the nodes cluster validation drains (cluster.exclude_unhealthy) --------------------------


def write_verdict(tmp_path: Path, drain: list[str]) -> Path:
    verdict = tmp_path / "validation" / "20261124-100000-000000" / "verdict.json"
    verdict.parent.mkdir(parents=True)
    reasons = ", ".join(f'"{node}": "memory_cpu: below threshold"' for node in drain)
    verdict.write_text(f'{{"drain": {{{reasons}}}, "unconfirmed": {{}}, "passed": []}}')
    return verdict


def excluding_unhealthy(tmp_path: Path) -> tuple[str, ...]:
    return (
        f"cluster.partition={MULTI_PARTITION}",
        "cluster.exclude_unhealthy=true",
        f"cluster.validation_results={tmp_path / 'validation'}",
    )


def test_drained_nodes_slurm_does_not_know_are_left_out_with_a_note(
    slurm_nodes: list[str], tmp_path: Path
) -> None:
    """A verdict of another cluster, or naming a node since removed: sbatch would refuse the
    whole --exclude ("Invalid node name specified"), so those names are left out."""
    drained, gone = slurm_nodes[2], "n-removed-7"
    verdict = write_verdict(tmp_path, [drained, gone])
    result = launch(tmp_path, *asking("training", 2), *excluding_unhealthy(tmp_path))
    assert result.returncode == 0, result.stderr
    notes = result.stdout.splitlines()[:2]
    assert notes[0] == (
        f"cluster: exclude_unhealthy: every job excludes the nodes to drain in {verdict}: {drained}"
    )
    assert notes[1].startswith(
        f"cluster: exclude_unhealthy: left out {gone}, which {verdict} drains but this cluster "
        "does not have"
    ), notes
    script = tmp_path / "results" / "gpt3_tiny" / "gpt3_tiny_submission.sh"
    assert f"#SBATCH --exclude={drained}\n" in script.read_text()
    # Slurm takes the script as it is (--test-only: checked, not submitted).
    checked = subprocess.run(
        ["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stderr


@pytest.mark.parametrize(
    ("stage", "nodes", "drained", "left"),
    [
        ("training", 1, 3, "which leaves none of partition multi's 3 nodes"),
        ("data_preparation", 1, 3, "which leaves none of partition multi's 3 nodes"),
        ("training", 2, 2, "which leaves 1 of partition multi's 3 nodes"),
        ("fine_tuning", 3, 1, "which leaves 2 of partition multi's 3 nodes"),
    ],
)
def test_a_verdict_that_leaves_too_few_nodes_is_refused_naming_it(
    slurm_nodes: list[str], tmp_path: Path, stage: str, nodes: int, drained: int, left: str
) -> None:
    verdict = write_verdict(tmp_path, slurm_nodes[:drained])
    asked = ("stages=[data_preparation]",) if stage == "data_preparation" else asking(stage, nodes)
    fine_tuning_batch = ("fine_tuning.model.global_batch_size=48",) * (stage == "fine_tuning")
    result = launch(tmp_path, *asked, *fine_tuning_batch, *excluding_unhealthy(tmp_path))
    assert_one_line_error(
        result,
        f"error: cluster.exclude_unhealthy: {verdict} drains {', '.join(slurm_nodes[:drained])}",
        left,
        "cluster.exclude_unhealthy=false",
    )
    assert not (tmp_path / "results").exists()


def test_cluster_exclude_that_leaves_too_few_nodes_is_refused(
    slurm_nodes: list[str], tmp_path: Path
) -> None:
    exclude = ",".join(slurm_nodes[:2])
    result = launch(
        tmp_path,
        *asking("training", 2),
        f"cluster.partition={MULTI_PARTITION}",
        f"cluster.exclude='{exclude}'",
    )
    assert_one_line_error(
        result,
        f"error: cluster.exclude: excludes {exclude}, which leaves 1 of partition multi's 3 nodes",
        "training.trainer.num_nodes=1",
    )
