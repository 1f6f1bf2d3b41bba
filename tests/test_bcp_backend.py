"""The Base Command Platform backend: what its scripts say, and that their wiring runs.

There is no bcprun here. The end-to-end tests put a one-node stand-in named `bcprun` on PATH
(tests/support/bcp.py): it runs the `-c` command once per node in `--workdir` with the `--env`
variables, every "node" being a process of this machine. They test our scripts' wiring (node
check, environment, quoting, torchrun rendezvous and ranks, logs, exit codes), not BCP: real
multi-node placement, networking and bcprun's own behaviour are not exercised.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launcher_scripts.clusters import BACKENDS, JobRecord
from launcher_scripts.clusters.bcp import BcpBackend, ngc_batch_run
from launcher_scripts.errors import ConfigError
from launcher_scripts.jobspec import Command, JobSpec, Resources
from tests.support import REPO
from tests.support.commands import run_main

PROGRAM = """
import os, sys
print(f"rank {os.environ.get('RANK', '-')} of {os.environ.get('WORLD_SIZE', '-')}: {sys.argv[1:]}")
print(f"ngc index {os.environ.get('NGC_ARRAY_INDEX', '-')} cwd {os.getcwd()}")
print(f"greeting {os.environ.get('GREETING', '-')}")
sys.exit(int(os.environ.get("EXIT_WITH", "0")))
"""


def job_in(folder: Path, *commands: Command, **fields) -> JobSpec:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hello_job.py").write_text(PROGRAM)
    return JobSpec(
        stage="test",
        name="hello",
        results_dir=str(folder),
        commands=commands,
        pythonpath=f"{folder}:{REPO}",
        **fields,
    )


def run_job(job: JobSpec) -> tuple[JobRecord, str]:
    backend = BcpBackend()
    script = Path(job.results_dir) / "hello.sh"
    script.write_text(backend.render(job))
    record = JobRecord("hello", "test", "bcp", str(script), backend.log_path(job, "run1"))
    backend.submit(str(script), job, record, [], lambda r: None)
    return record, Path(record.log).read_text()


# ----- what the scripts say ---------------------------------------------------------------


def test_bcp_is_a_registered_synchronous_backend() -> None:
    assert BACKENDS["bcp"] is BcpBackend and BcpBackend.synchronous


def test_multi_node_job_runs_torchrun_once_per_node_through_bcprun(tmp_path: Path) -> None:
    job = job_in(
        tmp_path,
        Command("hello_job", ("x",), nproc_per_node=8),
        resources=Resources(nodes=4, ntasks_per_node=8),
        env=(("GREETING", "hi there"),),
    )
    text = BcpBackend().render(job)
    assert "nodes=4\n" in text
    assert '--nnodes "$nodes" \\\n    --npernode 1 \\\n' in text
    assert f"--workdir {tmp_path}" in text
    assert "--env 'GREETING=hi there'" in text
    assert '--env "MASTER_ADDR=$MASTER_ADDR"' in text
    assert 'MASTER_ADDR="${NGC_MASTER_ADDR:-$(hostname)}"' in text
    assert "--rdzv-backend=c10d" in text and "--nproc-per-node=8" in text
    assert "unset SLURM_ARRAY_TASK_ID" in text and "NGC_ARRAY_INDEX" in text


def test_script_refuses_more_nodes_than_the_bcp_job_has(tmp_path: Path) -> None:
    """The check runs before bcprun, so no stand-in is needed to see it."""
    job = job_in(tmp_path, Command("hello_job"), resources=Resources(nodes=4))
    script = tmp_path / "hello.sh"
    script.write_text(BcpBackend().render(job))
    env = {**os.environ, "NGC_ARRAY_SIZE": "2"}
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env)
    assert result.returncode == 1
    assert (
        "launcher: job hello needs 4 nodes but this BCP job has 2 replicas (NGC_ARRAY_SIZE); "
        "start it with --replicas 4 or more"
    ) in result.stderr


def test_check_submission_needs_bcprun_and_enough_replicas(
    tmp_path: Path, bcp_node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = job_in(tmp_path, Command("hello_job"), resources=Resources(nodes=4))
    monkeypatch.setenv("NGC_ARRAY_SIZE", "2")
    with pytest.raises(ConfigError, match="needs 4 nodes but this BCP job has 2 replicas"):
        BcpBackend().check_submission([big])
    monkeypatch.setenv("NGC_ARRAY_SIZE", "4")
    BcpBackend().check_submission([big])
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ConfigError, match="bcprun is not on PATH"):
        BcpBackend().check_submission([big])


def test_ngc_batch_run_starts_a_job_big_enough_for_every_stage(tmp_path: Path) -> None:
    cluster = OmegaConf.load(REPO / "conf" / "cluster" / "bcp.yaml")
    cluster.image = "nvcr.io/nvidia/nemo:24.05"
    cluster.ace = "my-ace"
    jobs = [
        job_in(tmp_path, Command("hello_job"), resources=Resources(nodes=8)),
        job_in(tmp_path, Command("hello_job"), array_size=3),
    ]
    overrides = ["stages=[training]", "cluster=bcp", "cluster_type=bcp", "run.name=it's"]
    text = ngc_batch_run(cluster, jobs, overrides, "/opt/launcher")
    assert text.startswith("#!/usr/bin/env bash\nngc batch run")
    for flag in (
        "--instance dgxa100.80g.8.norm",
        "--image nvcr.io/nvidia/nemo:24.05",
        "--replicas 8",
        "--array-type PYTORCH",
        "--total-runtime 24h",
        "--result /results",
        "--workspace launcher_data_ws:/mount/data:RW",
        "--workspace launcher_results_ws:/mount/results:RW",
        "--ace my-ace",
    ):
        assert flag in text
    script = tmp_path / "ngc_batch_run.sh"
    script.write_text(text)
    # The command line survives two rounds of quoting: print what ngc would receive.
    printed = subprocess.run(
        ["bash", "-c", f"ngc() {{ printf '%s\\n' \"${{@: -1}}\"; }}; . {script}"],
        capture_output=True,
        text=True,
    )
    assert printed.stdout == (
        "cd /opt/launcher && python3 main.py 'stages=[training]' cluster=bcp cluster_type=bcp "
        "'run.name=it'\"'\"'s'\n"
    )


# ----- the scripts' wiring, run with the one-node bcprun stand-in -----------------------------


def test_wiring_with_bcprun_shim_quotes_paths_and_arguments(tmp_path: Path, bcp_node: Path) -> None:
    folder = tmp_path / "it's a dir"
    job = job_in(
        folder, Command("hello_job", ("a b", "it's", "$HOME")), env=(("GREETING", "hi 'you'"),)
    )
    record, log = run_job(job)
    assert record.state == "COMPLETED" and record.exit_code == 0, log
    assert record.log == str(folder / "log-hello_run1.out")  # the results folder's log
    assert "rank - of -: ['a b', \"it's\", '$HOME']" in log
    assert f"cwd {folder}" in log and "greeting hi 'you'" in log


def test_wiring_with_bcprun_shim_gives_torchrun_ranks(tmp_path: Path, bcp_node: Path) -> None:
    record, log = run_job(job_in(tmp_path, Command("hello_job", ("x",), nproc_per_node=2)))
    assert record.state == "COMPLETED", log
    assert "rank 0 of 2: ['x']" in log and "rank 1 of 2: ['x']" in log


def test_wiring_with_bcprun_shim_array_job_splits_by_process_rank(
    tmp_path: Path, bcp_node: Path
) -> None:
    """An array job meets at node 0's rendezvous; the BCP node index is hidden from it."""
    record, log = run_job(job_in(tmp_path, Command("hello_job", ("y",)), array_size=4))
    assert record.state == "COMPLETED", log
    assert "rank 0 of 1: ['y']" in log and "ngc index -" in log


def test_wiring_with_bcprun_shim_two_nodes_meet_at_node_0(
    tmp_path: Path, bcp_node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NGC_ARRAY_SIZE", "2")
    job = job_in(
        tmp_path, Command("hello_job", ("z",), nproc_per_node=2), resources=Resources(nodes=2)
    )
    record, log = run_job(job)
    assert record.state == "COMPLETED", log
    assert all(f"rank {rank} of 4: ['z']" in log for rank in range(4)), log


def test_wiring_with_bcprun_shim_array_job_uses_at_most_its_tasks_nodes(
    tmp_path: Path, bcp_node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NGC_ARRAY_SIZE", "3")
    record, log = run_job(job_in(tmp_path, Command("hello_job", ("w",)), array_size=2))
    assert record.state == "COMPLETED", log
    assert "rank 0 of 2: ['w']" in log and "rank 1 of 2: ['w']" in log
    assert "of 3" not in log


def test_wiring_with_bcprun_shim_failure_ends_the_job(tmp_path: Path, bcp_node: Path) -> None:
    job = job_in(
        tmp_path,
        Command("hello_job", ("first",)),
        Command("hello_job", ("second",)),
        env=(("EXIT_WITH", "3"),),
    )
    record, log = run_job(job)
    assert record.state == "FAILED" and record.exit_code == 3
    assert "['first']" in log and "['second']" not in log


def test_pipeline_with_bcprun_shim_stops_at_a_failing_job(tmp_path: Path, bcp_node: Path) -> None:
    results, data = tmp_path / "results", tmp_path / "data"
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\nnot json\n{"no_text": 1}\n' * 10)
    sample = REPO / "launcher_scripts" / "sample_data" / "tiny_corpus.jsonl.gz"
    result = run_main(
        "cluster=bcp",
        "cluster_type=bcp",
        f"base_results_dir={results}",
        f"data_dir={data}",
        "stages=[data_preparation]",
        f"data_preparation.raw_dataset_files=[{broken}]",
        f"data_preparation.train_tokenizer_args.input={sample}",
        "data_preparation.train_tokenizer_args.vocab_size=500",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert "custom_dataset-preprocess failed with exit code 1" in error
    log = next((results / "custom_dataset").glob("log-custom_dataset-preprocess_*.out"))
    assert str(log) in error and "broken.jsonl:2" in log.read_text()
    script = results / "custom_dataset" / "custom_dataset-preprocess_submission.sh"
    # The last command replaces the shell, so a cancel's signal reaches bcprun.
    assert "\nexec bcprun \\\n" in script.read_text()
    scripts = sorted(p.name for p in (results / "custom_dataset").glob("*_submission.sh"))
    assert scripts == [
        "custom_dataset-preprocess_submission.sh",
        "custom_dataset-train_tokenizer_submission.sh",
    ]


def test_a_dry_run_writes_the_ngc_command_that_starts_the_run(tmp_path: Path) -> None:
    common = (
        "cluster=bcp",
        "cluster_type=bcp",
        "stages=[data_preparation]",
        "dry_run=true",
        f"base_results_dir={tmp_path}/results",
        f"data_dir={tmp_path}/data",
    )
    refused = run_main(*common)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "error: cluster.image: is not set. Set cluster.image or container"
    ]
    assert not (tmp_path / "results").exists()

    result = run_main(*common, "cluster.image=nvcr.io/nvidia/nemo:24.05")
    assert result.returncode == 0, result.stderr
    script = tmp_path / "results" / "ngc_batch_run.sh"
    assert f"start the bcp job that runs this pipeline with: {script}" in result.stdout
    text = script.read_text()
    assert "--image nvcr.io/nvidia/nemo:24.05" in text and "python3 main.py" in text
    assert "dry_run=" not in text  # the job runs the pipeline for real
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_a_workstation_dry_run_leaves_the_workspaces_files_to_the_job(tmp_path: Path) -> None:
    """docs/clusters.md's example, from a workstation: the code, data and tokenizer are in BCP
    workspaces that are not mounted here, so the dry run lists them and goes on; a real run
    (on the BCP node) still stops at the first one missing."""
    code = tmp_path / "mount" / "code" / "launcher"  # not on this machine
    example = (
        "cluster_type=bcp",
        "stages=[data_preparation,training]",
        "training=gpt3/5b",
        "cluster.image=nvcr.io/nvidia/nemo:24.05",
        f"cluster.workspaces=[{{id: my_code, mount: {code.parent}}}]",
        f"launcher_scripts_path={code}",
        f"data_dir={tmp_path}/mount/data",
        f"base_results_dir={tmp_path}/results",
    )
    result = run_main(*example, "dry_run=true")
    assert result.returncode == 0, result.stderr
    assert f"{code}/launcher_scripts/sample_data/tiny_corpus.jsonl.gz" in result.stdout
    real = run_main(*example)
    assert real.returncode == 2
    assert real.stderr.startswith("error: data_preparation.raw_dataset_files[0]:"), real.stderr
