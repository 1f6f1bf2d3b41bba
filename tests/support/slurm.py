"""The CI's real Slurm (`.ci/slurm-up.sh`): this machine's node and three namespace nodes."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tests.support import REPO, missing
from tests.support.commands import run_main, run_ops

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


def submit_to_nodes(results: Path, *overrides: str) -> str:
    """A training of SMALL_CLUSTER's size on 2 of the namespace nodes, submitted through
    main.py with `overrides`: its Slurm job id."""
    submitted = run_main(
        f"base_results_dir={results}",
        "stages=[training]",
        *SMALL_CLUSTER,
        f"cluster.partition={MULTI_PARTITION}",
        "training.trainer.num_nodes=2",
        *overrides,
    )
    assert submitted.returncode == 0, submitted.stdout[-2000:] + submitted.stderr[-2000:]
    manifest = json.loads(run_ops("status", str(results), "--json").stdout)
    (job_id,) = manifest["stages"][0]["jobs"][0]["job_ids"]
    return job_id


ENDED = ("COMPLETED", "FAILED", "CANCELLED")


def wait_for_states(
    results: Path, reached: Callable[[dict[str, str]], bool], timeout: float = 1800
) -> dict[str, str]:
    """Poll `status --json` (another process, as a user would) until the jobs' states (by
    job name) are `reached`; returns them."""
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        result = run_ops("status", str(results), "--json")
        assert result.returncode == 0, result.stderr
        manifest = json.loads(result.stdout)
        states = {
            job["name"]: job["state"] for stage in manifest["stages"] for job in stage["jobs"]
        }
        if reached(states):
            return states
        time.sleep(2)
    raise AssertionError(
        f"the run's jobs did not reach the states awaited in {timeout} s: {states}"
    )


def wait_for_run(results: Path, timeout: float = 1800) -> dict[str, str]:
    """wait_for_states until every job has ended."""
    return wait_for_states(results, lambda states: set(states.values()) <= set(ENDED), timeout)


MULTI_PARTITION = "multi"  # .ci/slurm-up.sh's namespace nodes n1..n3


def srun_on_nodes(
    nodes: Sequence[str], *command: str, env: str = ""
) -> subprocess.CompletedProcess:
    """`command` as one task on each of the namespace nodes `nodes`, from the checkout; `env`
    adds to srun's --export=ALL (",NAME=value,...")."""
    return subprocess.run(
        [
            *("srun", "-p", MULTI_PARTITION, f"--nodelist={','.join(nodes)}"),
            *(f"--nodes={len(nodes)}", "--ntasks-per-node=1", "--export=ALL" + env),
            *command,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )


def require_slurm() -> None:
    """A running Slurm (`.ci/slurm-up.sh` starts one): skipped without, failed in CI."""
    ready = shutil.which("sbatch") and subprocess.run(
        ["scontrol", "ping"], capture_output=True, text=True
    ).stdout.count("UP")
    if not ready:
        missing("no running Slurm: start one with bash .ci/slurm-up.sh")


def usable_nodes() -> list[str]:
    """The usable nodes of the namespace-node partition (at least 3): skipped without, failed
    in CI."""
    listed = subprocess.run(
        ["sinfo", "-h", "-N", "-p", MULTI_PARTITION, "-o", "%N %T"], capture_output=True, text=True
    ).stdout.split("\n")
    usable = ("idle", "mixed", "allocated", "completing")
    nodes = [line.split()[0] for line in listed if line.strip() and line.split()[1] in usable]
    if len(nodes) < 3:
        missing(
            f"Slurm's partition {MULTI_PARTITION} has {len(nodes)} usable nodes, not 3: "
            "start them with bash .ci/slurm-up.sh"
        )
    return nodes
