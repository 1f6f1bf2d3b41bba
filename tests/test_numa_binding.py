"""numa_mapping: the cores each process of a GPU job is bound to, on synthetic topologies given
as data; the topology read from sysfs-like files; the wrapper on this real machine; and what the
scripts of every backend contain with numa_mapping on and off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher_scripts.clusters import BACKENDS
from launcher_scripts.config.compose import compose_config
from launcher_scripts.errors import ConfigError
from launcher_scripts.jobs.numa_binding import (
    BindingError,
    NumaPolicy,
    parse,
    select_cpus,
)
from launcher_scripts.jobs.numa_topology import (
    NoNumaInformation,
    Topology,
    format_cpulist,
    parse_cpulist,
    read_topology,
)
from launcher_scripts.pipeline import plan
from launcher_scripts.stages.base import NUMA_BINDING
from tests.support import REPO
from tests.support.golden_cases import case_overrides

SAMPLE = REPO / "launcher_scripts" / "sample_data" / "tiny_corpus.jsonl.gz"


def dgx_a100(allowed: frozenset[int] | None = None) -> Topology:
    """Two sockets of 64 cores with two hyperthreads each (CPU c and c + 128), four NUMA nodes
    per socket (16 cores each), and the eight GPUs on nodes 3, 3, 1, 1, 7, 7, 5, 5."""
    return Topology(
        node_cpus={
            node: (*range(16 * node, 16 * node + 16), *range(128 + 16 * node, 144 + 16 * node))
            for node in range(8)
        },
        gpu_nodes=(3, 3, 1, 1, 7, 7, 5, 5),
        cores=tuple((cpu, cpu + 128) for cpu in range(128)),
        node_sockets={node: node // 4 for node in range(8)},
        allowed=allowed,
    )


def with_siblings(cores: list[int] | range) -> list[int]:
    return sorted([*cores, *(core + 128 for core in cores)])


def cpus(topology: Topology, rank: int, ranks: int = 8, **policy: object) -> list[int]:
    return list(select_cpus(topology, NumaPolicy(**policy), rank, ranks).cpus)


# ----- core selection ---------------------------------------------------------------------------


def test_unique_contiguous_splits_each_node_among_its_gpus_in_blocks() -> None:
    dgx = dgx_a100()
    assert cpus(dgx, 0) == with_siblings(range(48, 56))  # node 3, first of its two GPUs
    assert cpus(dgx, 1) == with_siblings(range(56, 64))
    assert cpus(dgx, 2) == with_siblings(range(16, 24))  # node 1
    assert cpus(dgx, 7) == with_siblings(range(88, 96))  # node 5, second GPU
    binding = select_cpus(dgx, NumaPolicy(), 4, 8)
    assert (binding.gpu, binding.node, binding.physical_cores) == (4, 7, 8)


def test_unique_interleaved_deals_the_same_counts_round_robin() -> None:
    dgx = dgx_a100()
    assert cpus(dgx, 0, mode="unique_interleaved") == with_siblings(range(48, 64, 2))
    assert cpus(dgx, 1, mode="unique_interleaved") == with_siblings(range(49, 64, 2))


def test_all_gives_every_core_of_the_node_or_socket_shared() -> None:
    dgx = dgx_a100()
    assert cpus(dgx, 0, mode="all") == cpus(dgx, 1, mode="all") == with_siblings(range(48, 64))
    # Socket scope: all of socket 0's cores, its own node's first (max_cores keeps those).
    assert cpus(dgx, 0, mode="all", scope="socket") == with_siblings(range(0, 64))
    assert cpus(dgx, 0, mode="all", scope="socket", max_cores=16) == with_siblings(range(48, 64))
    assert cpus(dgx, 0, mode="all", scope="socket", max_cores=17) == with_siblings(
        [*range(48, 64), 0]
    )


def test_single_shares_the_first_core_and_single_unique_does_not() -> None:
    dgx = dgx_a100()
    assert cpus(dgx, 0, mode="single") == cpus(dgx, 1, mode="single") == [48, 176]
    assert cpus(dgx, 0, mode="single_unique") == [48, 176]
    assert cpus(dgx, 1, mode="single_unique") == [49, 177]
    assert cpus(dgx, 2, mode="single_unique") == [16, 144]
    # One core whatever min_cores and max_cores say, in either scope.
    assert cpus(dgx, 1, mode="single_unique", scope="socket", min_cores=4) == [49, 177]


def test_socket_scope_shares_out_the_cores_of_nodes_without_gpus() -> None:
    """Socket 0's nodes 0 and 2 have no GPU: their 32 cores go 8 each to the socket's 4 GPUs."""
    dgx = dgx_a100()
    assert cpus(dgx, 0, scope="socket") == with_siblings([*range(48, 56), *range(0, 8)])
    assert cpus(dgx, 1, scope="socket") == with_siblings([*range(56, 64), *range(8, 16)])
    assert cpus(dgx, 3, scope="socket") == with_siblings([*range(24, 32), *range(40, 48)])
    interleaved = cpus(dgx, 0, scope="socket", mode="unique_interleaved")
    assert interleaved == with_siblings([*range(48, 64, 2), *range(0, 16, 4), *range(32, 48, 4)])


def test_single_logical_keeps_one_hyperthread_per_core() -> None:
    dgx = dgx_a100()
    assert cpus(dgx, 0, cores="single_logical") == list(range(48, 56))
    assert cpus(dgx, 0, mode="single", cores="single_logical") == [48]


def test_max_cores_keeps_the_first_ones_and_min_cores_refuses_too_few() -> None:
    dgx = dgx_a100()
    assert cpus(dgx, 1, max_cores=3) == with_siblings(range(56, 59))
    assert cpus(dgx, 0, mode="all", max_cores=2) == with_siblings(range(48, 50))
    assert cpus(dgx, 0, min_cores=8) == with_siblings(range(48, 56))
    with pytest.raises(BindingError, match=r"GPU 0 \(NUMA node 3\) gets 8 physical cores"):
        cpus(dgx, 0, min_cores=9)
    with pytest.raises(BindingError, match="numa_mapping.min_cores=17"):
        cpus(dgx, 0, mode="all", min_cores=17)


def test_balanced_gives_every_gpu_the_smallest_share() -> None:
    """Node 0 has 10 cores for GPUs 0 and 1, node 1 has 4 cores for GPU 2."""
    uneven = Topology(node_cpus={0: tuple(range(10)), 1: tuple(range(10, 14))}, gpu_nodes=(0, 0, 1))
    assert cpus(uneven, 0, 3) == [0, 1, 2, 3]
    assert cpus(uneven, 1, 3) == [4, 5, 6, 7]
    assert cpus(uneven, 2, 3) == [10, 11, 12, 13]
    assert cpus(uneven, 0, 3, balanced=False) == [0, 1, 2, 3, 4]
    assert cpus(uneven, 1, 3, balanced=False) == [5, 6, 7, 8, 9]
    assert cpus(uneven, 1, 3, balanced=False, mode="unique_interleaved") == [1, 3, 5, 7, 9]
    # Balanced over sockets too: socket 0 has 6 extra cores for 2 GPUs, socket 1 has 2 for 1.
    sockets = Topology(
        node_cpus={
            0: tuple(range(4)),
            1: tuple(range(4, 10)),
            2: tuple(range(10, 12)),
            3: (12, 13),
        },
        gpu_nodes=(0, 0, 2),
        node_sockets={0: 0, 1: 0, 2: 1, 3: 1},
    )
    assert cpus(sockets, 0, 3, scope="socket") == [0, 1, 4, 5]
    assert cpus(sockets, 1, 3, scope="socket") == [2, 3, 6, 7]
    assert cpus(sockets, 1, 3, scope="socket", balanced=False) == [2, 3, 7, 8, 9]


def test_only_cpus_the_process_may_use_are_chosen() -> None:
    dgx = dgx_a100(allowed=frozenset([*range(48, 52), *range(176, 180), *range(16, 32)]))
    assert cpus(dgx, 0, 2) == [48, 49, 176, 177]  # node 3 has 4 usable cores: 2 each
    assert cpus(dgx, 1, 2) == [50, 51, 178, 179]
    # Balanced: node 7 (GPUs 4 and 5) has no usable core, so every GPU's share is empty.
    with pytest.raises(BindingError, match="gets 0 physical cores"):
        cpus(dgx, 0, 8)
    assert cpus(dgx, 0, 8, balanced=False) == [48, 49, 176, 177]
    with pytest.raises(BindingError, match="no core left for GPU 1"):
        cpus(dgx_a100(allowed=frozenset([48, 176])), 1, mode="single_unique")
    with pytest.raises(BindingError, match="gets 0 physical cores"):
        cpus(dgx_a100(allowed=frozenset(range(0, 16))), 0)


def test_gpus_without_a_known_node_bind_nothing() -> None:
    with pytest.raises(NoNumaInformation, match="NUMA node of GPU 1 is unknown"):
        cpus(Topology(node_cpus={0: (0, 1)}, gpu_nodes=(0, -1)), 0, 2)
    with pytest.raises(NoNumaInformation, match="sees 2 GPUs, fewer than the job's 4"):
        cpus(Topology(node_cpus={0: (0, 1)}, gpu_nodes=(0, 0)), 0, 4)


def test_cpu_lists_read_and_print_as_linux_writes_them() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpulist([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"


# ----- the topology of a machine ----------------------------------------------------------------


def fake_machine(root: Path) -> tuple[Path, Path]:
    """sysfs and procfs of two sockets, one NUMA node each, two cores of two hyperthreads per
    node, and two GPUs, one per node."""
    sys_root, proc_root = root / "sys", root / "proc"
    for node, cpu_list in ((0, "0-1,4-5"), (1, "2-3,6-7")):
        folder = sys_root / f"devices/system/node/node{node}"
        folder.mkdir(parents=True)
        (folder / "cpulist").write_text(cpu_list + "\n")
    for cpu in range(8):
        topology = sys_root / f"devices/system/cpu/cpu{cpu}/topology"
        topology.mkdir(parents=True)
        core = cpu % 4
        (topology / "thread_siblings_list").write_text(f"{core},{core + 4}\n")
        (topology / "physical_package_id").write_text(f"{core // 2}\n")
    for address, uuid, node in (
        ("0000:07:00.0", "GPU-aaaa-1111", 0),
        ("0000:0f:00.0", "GPU-bbbb-2222", 1),
    ):
        driver = proc_root / "driver/nvidia/gpus" / address
        driver.mkdir(parents=True)
        (driver / "information").write_text(f"Model: \t A100\nGPU UUID: \t {uuid}\n")
        device = sys_root / "bus/pci/devices" / address
        device.mkdir(parents=True)
        (device / "numa_node").write_text(f"{node}\n")
    (proc_root / "self").mkdir()
    (proc_root / "self/cgroup").write_text("0::/slurm/job_1/step_0\n")
    cgroup = sys_root / "fs/cgroup/slurm/job_1/step_0"
    cgroup.mkdir(parents=True)
    (cgroup / "cpuset.cpus.effective").write_text("0-3,6\n")
    return sys_root, proc_root


def test_the_topology_is_read_from_sysfs_and_the_driver(tmp_path: Path) -> None:
    sys_root, proc_root = fake_machine(tmp_path)
    topology = read_topology(None, sys_root, proc_root)
    assert topology.node_cpus == {0: (0, 1, 4, 5), 1: (2, 3, 6, 7)}
    assert topology.gpu_nodes == (0, 1)
    assert topology.cores == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert topology.node_sockets == {0: 0, 1: 1}
    assert topology.allowed == frozenset({0, 1, 2, 3, 6})  # the cgroup's cpuset
    # CUDA_VISIBLE_DEVICES picks and orders the GPUs, by index or UUID (prefix).
    for visible, nodes in (
        ("1,0", (1, 0)),
        ("GPU-bbbb", (1,)),
        ("MIG-1234", (-1,)),
        ("1,7,0", (1,)),
        ("", ()),
    ):
        assert read_topology(visible, sys_root, proc_root).gpu_nodes == nodes, visible
    binding = select_cpus(read_topology("1,0", sys_root, proc_root), NumaPolicy(), 0, 2)
    assert (binding.node, binding.cpus) == (1, (2, 3, 6))


def test_a_machine_without_numa_or_gpu_information_has_no_topology(tmp_path: Path) -> None:
    sys_root, proc_root = fake_machine(tmp_path)
    for gpu in (proc_root / "driver/nvidia/gpus").iterdir():
        for file in gpu.iterdir():
            file.unlink()
        gpu.rmdir()
    with pytest.raises(NoNumaInformation, match="lists no NVIDIA GPU"):
        read_topology(None, sys_root, proc_root)
    with pytest.raises(NoNumaInformation, match="lists no NUMA node"):
        read_topology(None, tmp_path / "empty", proc_root)


# ----- the wrapper on this machine --------------------------------------------------------------


def run_wrapper(*args: str, **env: str) -> subprocess.CompletedProcess:
    """The wrapper as a job's script starts it, running tests/scripts/affinity.py."""
    environment = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK")}
    environment.update(PYTHONPATH=str(REPO), **env)
    return subprocess.run(
        [sys.executable, "-u", "-m", NUMA_BINDING, *args, "--", "tests.scripts.affinity"]
        + ["an argument", "--flag=$(not run)"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=environment,
        timeout=120,
    )


def test_the_wrapper_binds_or_says_why_not_on_this_machine() -> None:
    """On a machine without NUMA or GPU information (a CPU box): one line, no binding. On one
    with GPUs: the chosen cores, one line per process."""
    policy = NumaPolicy(max_cores=2)
    result = run_wrapper(*policy.args(1))
    assert result.returncode == 0, result.stderr
    *lines, program = result.stdout.splitlines()
    printed = json.loads(program)
    assert printed["argv"] == ["an argument", "--flag=$(not run)"]
    try:
        topology = read_topology(os.environ.get("CUDA_VISIBLE_DEVICES"))
        expected = select_cpus(topology, policy, 0, 1)
    except NoNumaInformation as reason:
        assert lines == [f"numa_mapping: not binding: {reason}"]
        assert printed["cpus"] == sorted(os.sched_getaffinity(0))  # unchanged
        # Other ranks say nothing: the line is the node's, not each process's.
        other = run_wrapper(*policy.args(2), LOCAL_RANK="1", RANK="1", WORLD_SIZE="2")
        assert other.returncode == 0 and len(other.stdout.splitlines()) == 1
        return
    assert len(lines) == 1 and lines[0].startswith("numa_mapping: local rank 0: GPU 0 on NUMA")
    assert printed["cpus"] == list(expected.cpus)


def test_the_binding_is_applied_to_the_process() -> None:
    """bind() in a child process, on this machine's CPUs given as one NUMA node with one GPU:
    the process's affinity becomes the chosen CPU, and the line says so."""
    code = (
        "import json, os\n"
        "from launcher_scripts.jobs.numa_binding import NumaPolicy, bind\n"
        "from launcher_scripts.jobs.numa_topology import Topology\n"
        "cpus = tuple(sorted(os.sched_getaffinity(0)))\n"
        "line = bind(NumaPolicy(mode='single'), 1, Topology({0: cpus}, (0,)))\n"
        "print(json.dumps([line, sorted(os.sched_getaffinity(0)), cpus[0]]))\n"
    )
    environment = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK")}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**environment, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    line, affinity, first = json.loads(result.stdout)
    assert affinity == [first]
    assert line == (
        f"numa_mapping: local rank 0: GPU 0 on NUMA node 0: 1 physical cores, CPUs {first} "
        "(single, scope node, all_logical)"
    )


def test_settings_a_machine_cannot_meet_stop_the_job_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The wrapper's main() on a machine given as data, with min_cores above what it has: exit 2
    and one line, before the program would start."""
    from launcher_scripts.jobs import numa_binding

    monkeypatch.setattr(numa_binding, "read_topology", lambda _visible: dgx_a100())
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    code = numa_binding.main([*NumaPolicy(min_cores=99).args(8), "--", "never.started"])
    out, err = capsys.readouterr()
    assert code == numa_binding.EXIT_BAD_BINDING and out == ""
    assert err.startswith("error: numa_mapping: GPU 0 (NUMA node 3) gets 8 physical cores")
    assert err.count("\n") == 1 and "numa_mapping.min_cores=99" in err


def test_the_wrapper_options_round_trip() -> None:
    for policy in (
        NumaPolicy(),
        NumaPolicy("single_unique", "socket", "single_logical", False, 2, None),
        NumaPolicy("all", "node", "all_logical", True, 1, 4),
    ):
        assert parse([*policy.args(4), "--", "m"]) == (policy, 4, ["m"])


# ----- what the scripts contain -----------------------------------------------------------------


def planned_jobs(backend: str, case: str, *overrides: str) -> list:
    stage, composed = case_overrides(case, backend)
    if stage == "training":
        # One node of the recipe's eight: the local backend runs one machine, and this
        # machine's test Slurm partition has one node (the scripts' binding is per node).
        composed = [*composed, "training.trainer.num_nodes=1"]
    _, _, planned = plan(compose_config([*composed, "dry_run=true", *overrides]))
    return [job for stage in planned for job in stage.jobs]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_gpu_jobs_start_each_process_through_the_binding(backend: str) -> None:
    settings = (
        "numa_mapping.mode=single_unique",
        "numa_mapping.scope=socket",
        "numa_mapping.cores=single_logical",
        "numa_mapping.balanced=false",
        "numa_mapping.min_cores=2",
        "numa_mapping.max_cores=null",
    )
    expected = NumaPolicy("single_unique", "socket", "single_logical", False, 2, None)
    for case in ("training_gpt3_126m_container", "peft_gpt3_lora_tp2", "evaluation_gpt3_tp2"):
        [job] = planned_jobs(backend, case, *settings)
        [command] = job.spec.commands
        policy, ranks, program = parse(command.args)
        assert command.module == NUMA_BINDING and policy == expected
        assert ranks == command.nproc_per_node == job.spec.resources.gpus_per_node
        assert program[0].startswith("launcher_scripts.jobs.")
        for word in (NUMA_BINDING, "--mode=single_unique", f"--local-ranks={ranks}"):
            assert word in job.script  # in the script itself
        # Off: the program is started directly.
        [job] = planned_jobs(backend, case, "numa_mapping.enable=false")
        assert job.spec.commands[0].module == program[0]
        assert NUMA_BINDING not in job.script


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_cpu_jobs_are_not_bound(backend: str) -> None:
    cpu_cases = {
        "training_gpt3_126m_container": ("training.trainer.accelerator=cpu",),
        "training_gpt3_tiny": (),
        "conversion_gpt3": (),
        "export_gpt3": (),
        "custom_dataset_train_tokenizer": (f"data_preparation.raw_dataset_files=[{SAMPLE}]",),
        "download_gpt3_pile": (),
    }
    for case, overrides in cpu_cases.items():
        for job in planned_jobs(backend, case, *overrides):
            assert not job.spec.resources.gpus_per_node
            assert NUMA_BINDING not in job.script, (case, job.spec.name)


@pytest.mark.parametrize("flag", ["enable", "balanced"])
def test_numa_flags_must_be_booleans(flag: str) -> None:
    with pytest.raises(ConfigError) as error:
        planned_jobs("local", "training_gpt3_tiny", f"numa_mapping.{flag}=maybe")
    assert error.value.key == f"numa_mapping.{flag}"
