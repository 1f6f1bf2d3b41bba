"""PPO's servers layout on the CI's Slurm: the actor and the three role servers as one
heterogeneous job (a module of its own: the Slurm tests share one worker, and the rest of
tests/test_ppo.py need not wait there)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.commands import one_error_line, run_main, run_ops
from tests.support.ppo import ROLES, SERVED, SHORT, STAGE, metric_lines, overrides, reward_model
from tests.support.run_logs import job_log, metric
from tests.support.slurm import MULTI_PARTITION, wait_for_run


def slurm_run(results: Path, base: Path, scorer: Path, *extra: str) -> str:
    """The servers layout submitted to the CI's namespace nodes: the job's Slurm id."""
    submitted = run_main(
        *overrides(results, base, scorer, *SHORT, *SERVED, *extra),
        "cluster_type=bcm",
        "cluster.gpus_per_node=null",
        # Each component of a heterogeneous job has nodes of its own: the actor on this
        # machine's node, a server on each namespace node.
        "cluster.partition=batch",
        f"cluster.companion_partition={MULTI_PARTITION}",
    )
    assert submitted.returncode == 0, submitted.stdout[-2000:] + submitted.stderr[-2000:]
    manifest = json.loads(run_ops("status", str(results), "--json").stdout)
    (job_id,) = manifest["stages"][0]["jobs"][0]["job_ids"]
    return job_id


def queued(job_id: str) -> list[str]:
    """The job's components still in the queue."""
    listed = subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%i"], capture_output=True, text=True, check=True
    )
    return listed.stdout.split()


@pytest.mark.slow
def test_on_slurm_the_four_roles_are_one_job_and_end_together(
    slurm_nodes: list[str], sft_start: Path, tiny_reward_model: Path, tmp_path: Path
) -> None:
    """On the CI's Slurm: the actor and the three servers as the four components of one
    heterogeneous job, which finishes; then a second run, cancelled while it trains, saves the
    actor's checkpoint and ends all four."""
    del slurm_nodes
    scorer = reward_model(tiny_reward_model)
    too_small = run_main(
        *overrides(tmp_path / "refused", sft_start, scorer, *SERVED),
        "cluster_type=bcm",
        "cluster.gpus_per_node=null",
        f"cluster.partition={MULTI_PARTITION}",
        "dry_run=true",
    )
    one_error_line(too_small, f"{STAGE}.model.rlhf.layout", "need 4 nodes", "has 3 to give")
    done = tmp_path / "done"
    job_id = slurm_run(done, sft_start, scorer)
    assert wait_for_run(done, timeout=900) == {f"{STAGE}_gpt3_tiny": "COMPLETED"}
    trained = done / "gpt3_tiny" / STAGE / "results"
    assert sorted(metric(trained, "value_loss")) == [1, 2, 3, 4]
    script = (done / "gpt3_tiny" / STAGE / f"{STAGE}_gpt3_tiny_submission.sh").read_text()
    assert script.count("#SBATCH hetjob") == 3
    # Four allocations: each server on a node of its own (the actor on this machine's).
    hosts = {json.loads((trained / "servers" / f"{r}.json").read_text())["host"] for r in ROLES}
    assert len(hosts) == 3, hosts

    cancelled = tmp_path / "cancelled"
    job_id = slurm_run(cancelled, sft_start, scorer, f"{STAGE}.trainer.max_steps=400")
    results = cancelled / "gpt3_tiny" / STAGE / "results"
    deadline = time.monotonic() + 600
    while not metric_lines(results):
        assert time.monotonic() < deadline, "the run never started training"
        time.sleep(1)
    assert run_ops("cancel", str(cancelled)).returncode == 0
    wait_for_run(cancelled, timeout=600)
    assert queued(job_id) == []
    assert "stopped by a signal" in job_log(results)
    assert list((results / "checkpoints").glob("megatron_gpt_ppo_actor--*"))
