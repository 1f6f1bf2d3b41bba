"""CI's Slurm has three more nodes (`.ci/slurm-up.sh`): n1..n3 in partition "multi", each a
slurmd in its own network namespace. A job spread over them sees three hosts, each with its
own name and address, and a torch.distributed collective runs across them."""

from __future__ import annotations

import json
import subprocess

from tests.conftest import MULTI_PARTITION, REPO

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


def srun_python(nodes: list[str], program: str, *env: str) -> list[dict]:
    """`program` as one task on each of `nodes`; each task's JSON line."""
    result = subprocess.run(
        [
            *("srun", "-p", MULTI_PARTITION, f"--nodelist={','.join(nodes)}"),
            *(f"--nodes={len(nodes)}", "--ntasks-per-node=1", "--export=ALL" + "".join(env)),
            *("python3", "-c", program),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
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
    reports = srun_python(nodes, ALL_REDUCE, f",MASTER_ADDR={nodes[0]}")
    assert sorted(r["host"] for r in reports) == sorted(nodes)
    assert [r["sum"] for r in reports] == [6.0, 6.0, 6.0]
