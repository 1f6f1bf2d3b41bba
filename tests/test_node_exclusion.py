"""Keeping jobs off bad nodes: the nodes cluster validation drains (`cluster.exclude_unhealthy`),
and the node a failed multi-node attempt is requeued without (`launcher_scripts.jobs.failed_node`,
which the training script runs). Dry runs, without a cluster, and against this machine's Slurm
for what sinfo tells (the nodes it has); the Slurm side of both runs on CI's namespace nodes
(test_cluster_validation.py, test_slurm_nodes.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher_scripts.jobs.failed_node import first_failed_node
from tests.support.commands import run_main
from tests.support.dry_runs import without_slurm

KILLED = """\
rank 2/4 local_rank 0 host n2 device cpu launcher slurm: joining 4 processes at n1:20616
srun: error: n2: tasks 2-3: Killed
srun: launch/slurm: _step_signal: Terminating StepId=617.0
srun: error: n1: tasks 0-1: Terminated
"""


def failed_node(tmp_path: Path, log_text: str, attempt: int, *exclude: str):
    log = tmp_path / f"attempt{attempt}.out"
    log.write_text(log_text)
    return subprocess.run(
        [
            *(sys.executable, "-m", "launcher_scripts.jobs.failed_node", "--log", str(log)),
            *("--record", str(tmp_path / "excluded.json"), "--attempt", str(attempt)),
            *exclude,
        ],
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (KILLED, "n2"),
        (
            "srun: error: node-b: task 5: Exited with exit code 1\nsrun: error: node-a: task 0",
            "node-b",
        ),
        (
            "srun: error: Node failure on gpu-017\nsrun: error: gpu-001: tasks 0-7: Killed",
            "gpu-017",
        ),
        ("Traceback (most recent call last):\nValueError: bad\n", None),
    ],
)
def test_the_first_node_srun_names_is_the_failed_one(text: str, expected: str | None) -> None:
    found = first_failed_node(text)
    assert (found and found[0]) == expected


def test_each_requeue_excludes_every_node_failed_so_far(tmp_path: Path) -> None:
    first = failed_node(tmp_path, KILLED, 0, "--exclude", "n9")
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == "n9,n2"
    second = failed_node(tmp_path, KILLED.replace("n2", "n3"), 1, "--exclude", "n9")
    assert second.stdout.strip() == "n9,n2,n3"
    record = json.loads((tmp_path / "excluded.json").read_text())
    assert record == {
        "n2": {"attempt": 0, "srun": "srun: error: n2: tasks 2-3: Killed"},
        "n3": {"attempt": 1, "srun": "srun: error: n3: tasks 2-3: Killed"},
    }


def test_a_failure_srun_pins_on_no_node_is_not_requeued(tmp_path: Path) -> None:
    result = failed_node(tmp_path, "ValueError: bad\n", 0)
    assert result.returncode == 1 and result.stdout == ""
    assert "srun named no failed node" in result.stderr
    assert not (tmp_path / "excluded.json").exists()


def verdict(folder: Path, stamp: str, text: str) -> None:
    (folder / stamp).mkdir(parents=True)
    (folder / stamp / "verdict.json").write_text(text)


def dry_run(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return run_main(
        "stages=[training]",
        "cluster_type=bcm",
        "dry_run=true",
        "training.trainer.num_nodes=2",
        f"base_results_dir={tmp_path / 'results'}",
        "cluster.exclude_unhealthy=true",
        f"cluster.validation_results={tmp_path / 'validation'}",
        *overrides,
    )


def test_the_newest_validation_drains_nodes_from_every_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    without_slurm(monkeypatch)  # its nodes n3, n4 and n9 are no cluster's: none is checked
    old = '{"drain": {"n1": "old"}, "unconfirmed": {}, "passed": []}'
    verdict(tmp_path / "validation", "20261101-100000-000000", old)
    new = '{"drain": {"n3": "x", "n4": "y"}, "unconfirmed": {"n5": "z"}, "passed": ["n1"]}'
    verdict(tmp_path / "validation", "20261124-100000-000000", new)
    result = dry_run(tmp_path, "cluster.exclude=n9")
    assert result.returncode == 0, result.stderr
    newest = tmp_path / "validation" / "20261124-100000-000000" / "verdict.json"
    assert f"nodes to drain in {newest}: n3, n4" in result.stdout.splitlines()[0]
    script = (tmp_path / "results" / "gpt3_tiny" / "gpt3_tiny_submission.sh").read_text()
    assert "#SBATCH --exclude=n9,n3,n4\n" in script
    # A requeue after a node failure keeps them excluded too.
    assert "--exclude n9,n3,n4)" in script


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "holds no cluster validation result"),
        ("{not json", "is not a cluster validation verdict (JSONDecodeError"),
        ('{"passed": []}', "is not a cluster validation verdict (KeyError"),
        ('{"drain": ["n1"]}', "'drain' is not a mapping of node names to reasons"),
    ],
)
def test_a_missing_or_damaged_verdict_is_one_line(
    tmp_path: Path, text: str | None, message: str
) -> None:
    if text is not None:
        verdict(tmp_path / "validation", "20261124-100000-000000", text)
    result = dry_run(tmp_path)
    assert result.returncode != 0
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: cluster.validation_results: ") and message in line
    assert "cluster.exclude_unhealthy=false" in line or "Validate the cluster again" in line
    assert not (tmp_path / "results").exists()
