"""The Slurm backend on a real single-node Slurm (`.ci/slurm-up.sh` starts one).

Without Slurm these tests skip on a developer machine and fail in CI (CI=true).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher_scripts.formats.progress import TMP_PREFIX, newest_step
from launcher_scripts.ports import free_port
from tests.support import REPO
from tests.support.commands import run_main, run_ops
from tests.support.http_site import Site
from tests.support.pile import assert_pile_tokenized, pile_overrides, serve_pile
from tests.support.slurm import ENDED, MULTI_PARTITION, SMALL_CLUSTER, wait_for_run, wait_for_states
from tests.support.training import losses

SAMPLE = REPO / "launcher_scripts" / "sample_data" / "tiny_corpus.jsonl.gz"


@pytest.mark.slow
def test_array_data_preparation_then_two_task_training_on_slurm(
    slurm_nodes: list[str], tmp_path: Path
) -> None:
    """Data preparation as an array of two tasks, spread over two of the namespace nodes (each
    task asks for a whole node's CPUs), training on two srun tasks with TP=2, then conversion
    of its checkpoint."""
    second = tmp_path / "second.jsonl.gz"
    shutil.copy(SAMPLE, second)
    prefix = f"{tmp_path}/data/custom_dataset/preprocessed"
    results = tmp_path / "results"
    whole_node = subprocess.run(
        ["sinfo", "-h", "-p", MULTI_PARTITION, "-o", "%c"], capture_output=True, text=True
    ).stdout.split()[0]
    submitted = run_main(
        f"base_results_dir={results}",
        f"data_dir={tmp_path}/data",
        *[o for o in SMALL_CLUSTER if not o.startswith("data_preparation.run.cpus_per_node")],
        f"cluster.partition={MULTI_PARTITION}",
        f"data_preparation.run.cpus_per_node={whole_node}",
        f"data_preparation.raw_dataset_files=[{SAMPLE},{second}]",
        "data_preparation.run.node_array_size=2",
        "data_preparation.run.workers_per_node=1",
        f"training.model.data.data_prefix=[0.5,{prefix}/tiny_corpus_text_document,"
        f"0.5,{prefix}/second_text_document]",
        "training.trainer.devices=2",
        "training.model.tensor_model_parallel_size=2",
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert "all jobs submitted" in submitted.stdout
    states = wait_for_run(results)
    assert set(states.values()) == {"COMPLETED"}, states
    metrics = results / "gpt3_tiny" / "results" / "metrics.jsonl"
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert max(steps) == 6

    # One log per array task, each task its own share of the inputs, on a node of its own.
    hosts = set()
    for task in (0, 1):
        log = run_ops("logs", str(results), "custom_dataset-preprocess", "--task", str(task))
        assert log.returncode == 0, log.stderr
        assert f"task {task}" in log.stdout.splitlines()[0]
        found = re.search(rf"task {task} of 2 on (\S+): 1 of 2 inputs", log.stdout)
        assert found, log.stdout
        hosts.add(found.group(1))
    assert len(hosts) == 2 and hosts <= set(slurm_nodes), hosts
    # Two ranks started by srun, not torchrun, forming one TP group.
    training = run_ops("logs", str(results), "gpt3_tiny").stdout
    for rank in (0, 1):
        assert f"rank {rank}/2 local_rank {rank}" in training and "launcher slurm" in training
        assert f"rank {rank}: joined; tp {rank}/2 pp 0/1 dp 0/1" in training
    assert "6/6" in training
    converted = results / "gpt3_tiny" / "convert_nemo"
    assert (converted / "megatron_gpt.nemo").stat().st_size > 0
    assert (converted / "hf" / "config.json").is_file()


@pytest.mark.slow
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
    # The exit codes come from Slurm's job-completion records (sacct -c).
    status = json.loads(run_ops("status", str(results), "--json").stdout)
    codes = {job["name"]: job["exit_code"] for stage in status["stages"] for job in stage["jobs"]}
    assert codes["custom_dataset-train_tokenizer"] == 0, codes
    assert codes["custom_dataset-preprocess"] not in (None, 0), codes
    assert codes["gpt3_tiny"] is None, codes


@pytest.mark.slow
def test_cancel_of_a_running_training_checkpoints_and_is_not_requeued(
    slurm: None, prepared: Path, tmp_path: Path
) -> None:
    """`launcher_scripts cancel` asks the job to checkpoint (USR2 to the batch shell, which
    forwards the checkpoint signal), and the job then ends CANCELLED: not requeued, as the
    same signal from Slurm before the time limit would have it."""
    results = tmp_path / "results"
    submitted = run_main(
        f"base_results_dir={results}",
        f"data_dir={prepared}/data",
        "stages=[training]",
        *SMALL_CLUSTER,
        "training.trainer.max_steps=100000",
        "training.trainer.val_check_interval=100000",
        "training.exp_manager.checkpoint_callback_params.every_n_train_steps=3",
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    log_dir = results / "gpt3_tiny" / "results"
    checkpoints = log_dir / "checkpoints"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not newest_step(checkpoints):
        time.sleep(0.5)
    before = newest_step(checkpoints)
    assert before, "no first checkpoint within 600 s"
    # Steps past it, which a cancel that saves nothing would lose.
    while time.monotonic() < deadline and max(losses(log_dir), default=0) < before + 2:
        time.sleep(0.5)

    cancelled = run_ops("cancel", str(results), timeout=600)
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    assert "sent its checkpoint signal" in cancelled.stdout, cancelled.stdout
    assert "gpt3_tiny: stopped" in cancelled.stdout, cancelled.stdout
    assert wait_for_run(results, timeout=300) == {"gpt3_tiny": "CANCELLED"}
    assert newest_step(checkpoints) > before
    assert not [p.name for p in checkpoints.iterdir() if p.name.startswith(TMP_PREFIX)]
    job_id = json.loads(run_ops("status", str(results), "--json").stdout)["stages"][0]["jobs"][0][
        "job_ids"
    ][0]
    attempts = sorted(p.name for p in (results / "gpt3_tiny").glob(f"log-gpt3_tiny_{job_id}_*"))
    assert attempts == [f"log-gpt3_tiny_{job_id}_attempt0.out"]
    log = (results / "gpt3_tiny" / attempts[0]).read_text()
    assert "checkpoint saved; exit code 75" in log and "not requeued" in log, log[-3000:]
    assert "requeueing" not in log and "BrokenPipeError" not in log
    queue = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True)
    assert queue.stdout.strip() == ""


@pytest.mark.slow
def test_pile_steps_are_chained_task_to_task(slurm: None, site: Site, tmp_path: Path) -> None:
    """download -> extract -> preprocess as arrays joined by aftercorr: extract task 0 runs while
    download task 1 is still stalled on its shard."""
    tokenizer, shards = serve_pile(site, tmp_path)
    site.behaviour.stall_after["01.jsonl.zst"] = 100
    site.behaviour.stall_s = 15
    results, data = tmp_path / "results", tmp_path / "data"
    submitted = run_main(
        f"base_results_dir={results}",
        f"data_dir={data}",
        *pile_overrides(site),
        "cluster_type=bcm",
        "cluster.gpus_per_node=null",
        "data_preparation.run.node_array_size=2",
        "data_preparation.run.workers_per_node=1",
        "data_preparation.rm_downloaded=false",
        "data_preparation.rm_extracted=false",
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    states = wait_for_run(results)
    assert set(states.values()) == {"COMPLETED"}, states
    assert_pile_tokenized(data, tokenizer, shards)
    # Under afterok, shard 0 could only be extracted after the whole download array ended.
    assert (data / "00.jsonl").stat().st_mtime < (data / "01.jsonl.zst").stat().st_mtime
    for step in ("download", "extract", "preprocess"):
        for task in (0, 1):
            log = run_ops("logs", str(results), f"download_gpt3_pile-{step}", "--task", str(task))
            assert f"task {task} of 2" in log.stdout, log.stdout


@pytest.mark.slow
def test_cancel_from_another_process_stops_every_job(slurm: None, tmp_path: Path) -> None:
    """Cancelled once data preparation has completed and training runs (100000 steps: it
    cannot end by itself before the cancel), with the later stages waiting on it: the cancel
    reaches exactly the jobs that have not ended, and each of them ends CANCELLED. No state
    depends on when the cancel comes."""
    results = tmp_path / "results"
    submitted = run_main(
        f"base_results_dir={results}",
        f"data_dir={tmp_path}/data",
        *SMALL_CLUSTER,
        "training.trainer.max_steps=100000",
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    before = wait_for_states(results, lambda states: states["gpt3_tiny"] == "RUNNING", 900)
    assert len(before) == 6, before
    ended = {name for name, state in before.items() if state in ENDED}
    assert all(before[name] == "COMPLETED" for name in ended), before
    cancelled = run_ops("cancel", str(results))
    assert cancelled.returncode == 0, cancelled.stderr
    asked = {
        line.split()[2] for line in cancelled.stdout.splitlines() if "cancel requested" in line
    }
    assert asked == set(before) - ended, cancelled.stdout
    states = wait_for_run(results, timeout=900)
    assert states == {name: "COMPLETED" if name in ended else "CANCELLED" for name in before}
    manifest = json.loads(run_ops("status", str(results), "--json").stdout)
    ids = [i for stage in manifest["stages"] for job in stage["jobs"] for i in job["job_ids"]]
    queue = subprocess.run(
        ["squeue", "-h", "-j", ",".join(ids)], capture_output=True, text=True
    ).stdout
    assert queue.strip() == ""


def test_more_cpus_than_any_node_has_is_refused_before_submitting(
    slurm: None, tmp_path: Path
) -> None:
    results = tmp_path / "results"
    refused = run_main(
        f"base_results_dir={results}",
        f"data_dir={tmp_path}/data",
        *SMALL_CLUSTER,
        "data_preparation.run.cpus_per_node=100000",
    )
    assert refused.returncode == 2
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith("error: data_preparation.run.cpus_per_node: job custom_dataset-"), line
    assert "Set data_preparation.run.cpus_per_node=" in line
    assert not results.exists()


def test_a_controller_that_does_not_answer_is_refused_before_anything_is_written(
    slurm: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This cluster's slurm.conf with its controller on a port nothing listens on: sinfo
    fails as on a login node whose slurmctld is down."""
    conf = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")).read_text()
    dead = f"SlurmctldHost=nowhere(127.0.0.1)\nSlurmctldPort={free_port()}"
    (tmp_path / "slurm.conf").write_text(re.sub(r"(?m)^SlurmctldHost=.*$", dead, conf))
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    results = tmp_path / "results"
    refused = run_main(f"base_results_dir={results}", f"data_dir={tmp_path}/data", *SMALL_CLUSTER)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert lines[0].startswith("error: cluster_type: is bcm but Slurm does not answer ("), lines
    assert "Unable to contact slurm controller" in lines[0]
    assert "scontrol ping" in lines[0]
    assert not results.exists()


@contextlib.contextmanager
def served_on_slurm(export: Path, *overrides: str) -> Iterator[tuple[str, dict[str, str]]]:
    """`serve EXPORT --slurm overrides...` until it says where it listens; yields (job id,
    endpoint.json's contents) and cancels the job after the block, waiting until it is gone."""
    endpoint = export / "endpoint.json"
    submitted = run_ops(
        "serve", str(export), "--slurm", "export.serving.gpus_per_node=0", *overrides
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job_id = re.search(r"Slurm job (\d+)", submitted.stdout).group(1)  # type: ignore[union-attr]
    try:
        deadline = time.monotonic() + 1800  # queued behind other jobs, then loading the models
        while not endpoint.is_file():
            state = subprocess.run(
                ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True
            ).stdout.strip()
            log = "".join(p.read_text() for p in export.glob("slurm-serve_*.out"))
            assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"{state}\n{log[-3000:]}"
            assert time.monotonic() < deadline, log[-3000:]
            time.sleep(1)
        yield job_id, json.loads(endpoint.read_text())
    finally:
        subprocess.run(["scancel", job_id], check=True)
    deadline = time.monotonic() + 600
    while subprocess.run(
        ["squeue", "-h", "-j", job_id], capture_output=True, text=True
    ).stdout.strip():
        assert time.monotonic() < deadline, "the serving job did not stop"
        time.sleep(1)


def test_serve_runs_triton_as_a_slurm_job(slurm: None, exported: Path, triton_python: Path) -> None:
    """`serve --slurm`: the server starts as a job, says where it listens, answers, and stops
    with scancel."""
    with served_on_slurm(exported, "cluster.gpus_per_node=null") as (_job, where):
        port = where["http"].rsplit(":", 1)[1]
        answer = subprocess.run(
            [str(triton_python), "-c", QUERY, port], capture_output=True, text=True, timeout=600
        )
        assert answer.returncode == 0, answer.stderr[-2000:]
        assert answer.stdout.strip()


def test_a_tp2_model_is_served_across_two_slurm_nodes_as_tp1_serves_it(
    slurm: None, exported: Path, tp2_export: Path, tmp_path: Path
) -> None:
    """The reference's TP=2 export served by a two-node job (one model rank on each namespace
    node, Triton on the first): the ensemble, asked by the end-to-end client at the address
    the job wrote, answers the text the TP=1 export's check generated."""
    export = tmp_path / "export"
    shutil.copytree(tp2_export, export, copy_function=os.link)
    (export / "endpoint.json").unlink(missing_ok=True)
    check = json.loads((exported / "check.json").read_text())
    overrides = ("cluster.gpus_per_node=null", f"cluster.partition={MULTI_PARTITION}")
    with served_on_slurm(export, *overrides, "export.serving.nodes=2") as (job_id, where):
        nodes = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True
        ).stdout.strip()
        assert nodes == "n[1-2]" and where["host"] == "n1", (nodes, where)
        answer = run_ops("client", str(export), check["prompt"])
        assert answer.returncode == 0, answer.stderr
        assert answer.stdout.splitlines() == [
            f"{check['prompt']}{check['text']}  [{check['finish_reason']}]"
        ]
    log = next(export.glob("slurm-serve_*.out")).read_text()
    assert "TP=2 x PP=1 (2 process(es) spread over the job's nodes)" in log


QUERY = """
import sys
import numpy as np
import tritonclient.http as http

client = http.InferenceServerClient(f"localhost:{sys.argv[1]}")
text = http.InferInput("text_input", [1, 1], "BYTES")
text.set_data_from_numpy(np.array([["The history of"]], dtype=object))
print(client.infer("gpt3_tiny", [text]).as_numpy("text_output")[0][0].decode())
"""
