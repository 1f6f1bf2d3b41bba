"""CI's Slurm has three more nodes (`.ci/slurm-up.sh`): n1..n3 in partition "multi", each a
slurmd in its own network namespace. A job spread over them sees three hosts, each with its
own name and address; a torch.distributed collective runs across them; the launcher's training
runs on two of them as one process does."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.conftest import (
    MULTI_PARTITION,
    SMALL_CLUSTER,
    assert_same_losses,
    run_main,
    run_ops,
    srun_on_nodes,
    wait_for_run,
)

REPORT = """
import json, os, socket
host = socket.gethostname()
print(json.dumps({"host": host, "node_id": os.environ["SLURM_NODEID"],
                  "address": socket.gethostbyname(host)}))
"""

ALL_REDUCE = """
import json, os, socket
import torch, torch.distributed as dist
dist.init_process_group(
    "gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:29531",
    rank=int(os.environ["SLURM_PROCID"]), world_size=int(os.environ["SLURM_NTASKS"]))
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
print(json.dumps({"host": socket.gethostname(), "sum": total.item()}))
dist.destroy_process_group()
"""


def srun_python(nodes: list[str], program: str, env: str = "") -> list[dict]:
    """`program` as one task on each of `nodes`; each task's JSON line."""
    result = srun_on_nodes(nodes, "python3", "-c", program, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def test_each_node_is_its_own_host(slurm_nodes: list[str]) -> None:
    reports = srun_python(slurm_nodes[:3], REPORT)
    assert sorted(r["host"] for r in reports) == sorted(slurm_nodes[:3])
    assert sorted(r["node_id"] for r in reports) == ["0", "1", "2"]
    assert len({r["address"] for r in reports}) == 3
    assert not any(r["address"].startswith("127.") for r in reports), reports


def test_a_collective_runs_across_the_nodes(slurm_nodes: list[str]) -> None:
    nodes = slurm_nodes[:3]
    reports = srun_python(nodes, ALL_REDUCE, env=f",MASTER_ADDR={nodes[0]}")
    assert sorted(r["host"] for r in reports) == sorted(nodes)
    assert [r["sum"] for r in reports] == [6.0, 6.0, 6.0]


def test_training_on_two_nodes_trains_as_one_process(
    slurm_nodes: list[str], prepared: Path, tmp_path: Path
) -> None:
    """2 nodes x 2 srun tasks: TP=2 within a node, data parallel across the two nodes, the
    rendezvous at the first node's name (MASTER_ADDR from the job's node list)."""
    steps = (
        "stages=[training]",
        f"data_dir={prepared}/data",
        # The same kernels in both runs whatever CPUs the Slurm step is given.
        "+env_vars.OMP_NUM_THREADS=1",
        # One padded vocabulary at TP 1 and TP 2 (8192 rows), so both compute the same logits.
        "training.model.make_vocab_size_divisible_by=4096",
        f"training.model.data.index_mapping_dir={tmp_path}/index",
    )
    on_this_machine = [o for o in SMALL_CLUSTER if not o.startswith("cluster")]
    reference = run_main(
        f"base_results_dir={tmp_path}/reference", *steps, *on_this_machine, "cluster_type=local"
    )
    assert reference.returncode == 0, reference.stderr[-2000:]

    results = tmp_path / "nodes"
    submitted = run_main(
        f"base_results_dir={results}",
        *steps,
        *SMALL_CLUSTER,
        f"cluster.partition={MULTI_PARTITION}",
        "training.trainer.num_nodes=2",
        "training.trainer.devices=2",
        "training.model.tensor_model_parallel_size=2",
    )
    assert submitted.returncode == 0, submitted.stdout[-2000:] + submitted.stderr[-2000:]
    assert wait_for_run(results) == {"gpt3_tiny": "COMPLETED"}
    log = run_ops("logs", str(results), "gpt3_tiny").stdout
    hosts = dict(re.findall(r"rank (\d)/4 local_rank \d host (\S+) ", log))
    assert len(hosts) == 4 and len(set(hosts.values())) == 2, log[-3000:]
    assert hosts["0"] == hosts["1"] != hosts["2"] == hosts["3"], hosts
    assert f"joining 4 processes at {hosts['0']}:" in log
    for rank, placement in (("0", "tp 0/2 pp 0/1 dp 0/2"), ("3", "tp 1/2 pp 0/1 dp 1/2")):
        assert f"rank {rank}: joined; {placement}" in log, log[-3000:]
    assert_same_losses(
        tmp_path / "reference" / "gpt3_tiny" / "results",
        results / "gpt3_tiny" / "results",
        1e-4,
    )
