"""The Slurm backend on a real single-node Slurm (`.ci/slurm-up.sh` starts one).

Without Slurm these tests skip on a developer machine and fail in CI (CI=true).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_main, run_ops
from tests.test_training import losses

SAMPLE = REPO / "launcher_scripts" / "sample_data" / "tiny_corpus.jsonl.gz"
# The tiny pipeline, sized for a 2-core node: no CPU count the node lacks, a short training.
SMALL_CLUSTER = (
    "cluster_type=bcm",
    "cluster.gpus_per_node=null",
    "data_preparation.run.cpus_per_node=null",
    "data_preparation.train_tokenizer_args.vocab_size=1000",
    "training.trainer.max_steps=6",
    "training.model.optim.sched.warmup_steps=2",
    "training.trainer.val_check_interval=3",
    "training.trainer.log_every_n_steps=1",
    "training.model.num_layers=2",
    "training.model.hidden_size=64",
    "training.model.ffn_hidden_size=256",
)


@pytest.fixture(scope="module")
def slurm() -> None:
    ready = shutil.which("sbatch") and subprocess.run(
        ["scontrol", "ping"], capture_output=True, text=True
    ).stdout.count("UP")
    if not ready:
        message = "no running Slurm: start one with bash .ci/slurm-up.sh"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


def wait_for_run(results: Path, timeout: float = 600) -> dict[str, str]:
    """Poll `status --json` (another process, as a user would) until every job has ended."""
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        result = run_ops("status", str(results), "--json")
        assert result.returncode == 0, result.stderr
        manifest = json.loads(result.stdout)
        states = {
            job["name"]: job["state"] for stage in manifest["stages"] for job in stage["jobs"]
        }
        if all(state in ("COMPLETED", "FAILED", "CANCELLED") for state in states.values()):
            return states
        time.sleep(2)
    raise AssertionError(f"the run did not end in {timeout} s: {states}")


def test_pipeline_runs_in_order_on_slurm(slurm: None, tmp_path: Path) -> None:
    results = tmp_path / "results"
    submitted = run_main(f"base_results_dir={results}", f"data_dir={tmp_path}/data", *SMALL_CLUSTER)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert "all jobs submitted" in submitted.stdout
    states = wait_for_run(results)
    assert set(states.values()) == {"COMPLETED"}, states
    metrics = tmp_path / "results" / "gpt3_tiny" / "results" / "metrics.jsonl"
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert max(steps) == 6
    logs = run_ops("logs", str(results / "gpt3_tiny"))
    assert logs.returncode == 0 and "6/6" in logs.stdout


def test_a_failed_upstream_cancels_its_dependents(slurm: None, tmp_path: Path) -> None:
    broken = tmp_path / "broken.jsonl"
    broken.write_text("not json\n" * 50)
    results = tmp_path / "results"
    submitted = run_main(
        f"base_results_dir={results}",
        f"data_dir={tmp_path}/data",
        *SMALL_CLUSTER,
        f"data_preparation.train_tokenizer_args.input={SAMPLE}",
        f"data_preparation.raw_dataset_files=[{broken}]",
        f"training.model.data.data_prefix=[{tmp_path}/data/custom_dataset/preprocessed/"
        "broken_text_document]",
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    states = wait_for_run(results)
    assert states["custom_dataset-preprocess"] == "FAILED", states
    assert states["gpt3_tiny"] == "CANCELLED", states


def test_preempted_training_checkpoints_requeues_and_resumes(slurm: None, tmp_path: Path) -> None:
    """USR1 to the batch shell (what --signal=B:USR1@grace sends before the time limit)."""
    steps = (
        "training.trainer.max_steps=40",
        "training.exp_manager.checkpoint_callback_params.every_n_train_steps=20",
        "training.trainer.val_check_interval=20",
        # The same kernels in both runs whatever CPUs the Slurm step is given.
        "+env_vars.OMP_NUM_THREADS=1",
    )
    data = f"data_dir={tmp_path}/data"
    prepared = run_main(
        f"base_results_dir={tmp_path}/prep", data, "stages=[data_preparation]", *SMALL_CLUSTER
    )
    assert prepared.returncode == 0, prepared.stderr
    assert wait_for_run(tmp_path / "prep") == {
        "custom_dataset-train_tokenizer": "COMPLETED",
        "custom_dataset-preprocess": "COMPLETED",
    }
    local = ("stages=[training]", *SMALL_CLUSTER, *steps, "cluster_type=local")
    reference = run_main(f"base_results_dir={tmp_path}/reference", data, *local)
    assert reference.returncode == 0, reference.stderr[-2000:]

    results = tmp_path / "slurm"
    submitted = run_main(
        f"base_results_dir={results}", data, "stages=[training]", *SMALL_CLUSTER, *steps
    )
    assert submitted.returncode == 0, submitted.stderr
    manifest = json.loads(run_ops("status", str(results), "--json").stdout)
    job_id = manifest["stages"][0]["jobs"][0]["job_ids"][0]
    log_dir = results / "gpt3_tiny" / "results"
    metrics = log_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (metrics.exists() and len(losses(log_dir)) >= 3):
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)

    assert wait_for_run(results) == {"gpt3_tiny": "COMPLETED"}
    logs = sorted(p.name for p in (results / "gpt3_tiny").glob(f"log-gpt3_tiny_{job_id}_attempt*"))
    assert logs == [f"log-gpt3_tiny_{job_id}_attempt0.out", f"log-gpt3_tiny_{job_id}_attempt1.out"]
    first = (results / "gpt3_tiny" / logs[0]).read_text()
    assert "checkpoint saved; exit code 75" in first and "requeueing" in first
    assert "resumed from" in (results / "gpt3_tiny" / logs[1]).read_text()
    expected = losses(tmp_path / "reference" / "gpt3_tiny" / "results")
    assert losses(log_dir) == expected
