"""data_curation on the CI's real Slurm: every step an array over the namespace nodes, with
the output a single local process writes for the same recipe.

Without Slurm these tests skip on a developer machine and fail in CI (CI=true).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.support.commands import run_main, run_ops
from tests.support.curation import curate_overrides, mixed_corpus, output_files, write_shards
from tests.support.slurm import MULTI_PARTITION, wait_for_run


@pytest.mark.slow
def test_curation_as_slurm_arrays_writes_what_one_local_process_writes(
    slurm_nodes: list[str], tmp_path: Path
) -> None:
    files = write_shards(tmp_path / "raw", mixed_corpus(31, 600), 6)
    recipe = (
        "data_curation.steps=[clean,heuristics]",
        "data_curation.tasks=6",
        "data_curation.dedup_partitions=3",
    )
    local = run_main(
        *curate_overrides(
            tmp_path / "local", files, *recipe, "data_curation.run.workers_per_node=1"
        )
    )
    assert local.returncode == 0, local.stderr[-3000:]
    on_slurm = tmp_path / "slurm"
    whole_node = subprocess.run(
        ["sinfo", "-h", "-p", MULTI_PARTITION, "-o", "%c"], capture_output=True, text=True
    ).stdout.split()[0]  # so that each array task has a node of its own
    submitted = run_main(
        *curate_overrides(on_slurm, files, *recipe),
        "cluster_type=bcm",
        "cluster.gpus_per_node=null",
        f"cluster.partition={MULTI_PARTITION}",
        "data_curation.run.node_array_size=3",
        f"data_curation.run.cpus_per_node={whole_node}",
        "data_curation.run.workers_per_node=2",
    )
    assert submitted.returncode == 0, submitted.stdout[-2000:] + submitted.stderr[-2000:]
    states = wait_for_run(on_slurm / "results")
    assert set(states.values()) == {"COMPLETED"}, states
    assert output_files(on_slurm) == output_files(tmp_path / "local")
    assert (on_slurm / "results" / "curate_jsonl" / "curation_report.png").stat().st_size > 0

    # Each array task took its own share of the tasks, on a node of its own.
    hosts = set()
    for task in range(3):
        log = run_ops(
            "logs", str(on_slurm / "results"), "curate_jsonl-documents", "--task", str(task)
        )
        assert log.returncode == 0, log.stderr
        found = re.search(rf"task {task} of 3 on (\S+): units \[{task}, {task + 3}\]", log.stdout)
        assert found, log.stdout
        hosts.add(found.group(1))
    assert len(hosts) == 3 and hosts <= set(slurm_nodes), hosts
