"""The CPU and GPU topology of this machine as plain data, read from Linux's sysfs and the
NVIDIA driver's /proc files (no NVML, no torch): what launcher_scripts.jobs.numa_binding
chooses cores from.

GPU order. The driver lists its GPUs by PCI address (/proc/driver/nvidia/gpus/<address>/), the
order of NVML and nvidia-smi; CUDA orders the GPUs of one model the same way (its default
"fastest first" breaks ties by PCI address), so GPU i here is CUDA device i on the machines a
training job runs on (all GPUs alike). CUDA_VISIBLE_DEVICES, as indexes or GPU UUIDs, picks and
reorders them as CUDA does. Inside a container, the NVIDIA runtime lists only the container's
GPUs there.

Which CPUs a process may use: its cgroup's cpuset (the job's allocation, under Slurm and
Kubernetes), else its affinity mask. The cgroup comes first because srun may already have bound
each task to a few cores, and the binding replaces that.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

SYS = Path("/sys")
PROC = Path("/proc")


class NoNumaInformation(Exception):
    """This machine says nothing about which CPUs are near a GPU (the reason is the message)."""


@dataclass(frozen=True)
class Topology:
    """node_cpus: each NUMA node's logical CPUs. gpu_nodes: the NUMA node of each GPU this
    process sees, in CUDA's order (-1: unknown). cores: the logical CPUs of each physical core
    (hyperthread siblings); a CPU in none is a core of its own. node_sockets: each node's
    socket; a node in none is a socket of its own. allowed: the CPUs the process may use
    (None: every CPU)."""

    node_cpus: Mapping[int, tuple[int, ...]]
    gpu_nodes: tuple[int, ...]
    cores: tuple[tuple[int, ...], ...] = ()
    node_sockets: Mapping[int, int] = field(default_factory=dict)
    allowed: frozenset[int] | None = None


def parse_cpulist(text: str) -> list[int]:
    """Linux's list format: "0-3,8,10-11" → [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return cpus


def format_cpulist(cpus: list[int] | tuple[int, ...]) -> str:
    """The inverse of parse_cpulist, for log lines."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def read_topology(
    visible_devices: str | None = None, sys_root: Path = SYS, proc_root: Path = PROC
) -> Topology:
    """This machine's topology, as the process with CUDA_VISIBLE_DEVICES=`visible_devices`
    (None: unset) sees it. NoNumaInformation when there is nothing to bind by."""
    node_cpus = {
        int(path.parent.name.removeprefix("node")): tuple(parse_cpulist(path.read_text()))
        for path in sorted((sys_root / "devices/system/node").glob("node[0-9]*/cpulist"))
    }
    if not node_cpus:
        raise NoNumaInformation(f"{sys_root}/devices/system/node lists no NUMA node")
    gpus = _driver_gpus(sys_root, proc_root)
    if not gpus:
        raise NoNumaInformation(f"{proc_root}/driver/nvidia/gpus lists no NVIDIA GPU")
    cpus = sorted(cpu for members in node_cpus.values() for cpu in members)
    return Topology(
        node_cpus=node_cpus,
        gpu_nodes=_visible_nodes(gpus, visible_devices),
        cores=_physical_cores(cpus, sys_root),
        node_sockets=_node_sockets(node_cpus, sys_root),
        allowed=allowed_cpus(sys_root, proc_root),
    )


def _driver_gpus(sys_root: Path, proc_root: Path) -> list[tuple[str, int]]:
    """(UUID, NUMA node) of each GPU the driver lists, by PCI address."""
    gpus = []
    for folder in sorted((proc_root / "driver/nvidia/gpus").glob("*")):
        information = folder / "information"
        text = information.read_text() if information.is_file() else ""
        match = re.search(r"^GPU UUID:\s*(\S+)", text, re.MULTILINE)
        numa_file = sys_root / "bus/pci/devices" / folder.name.lower() / "numa_node"
        node = int(numa_file.read_text()) if numa_file.is_file() else -1
        gpus.append((match[1] if match else "", node))
    return gpus


def _visible_nodes(gpus: list[tuple[str, int]], visible_devices: str | None) -> tuple[int, ...]:
    if visible_devices is None:
        return tuple(node for _uuid, node in gpus)
    nodes = []
    for entry in filter(None, (part.strip() for part in visible_devices.split(","))):
        if entry.isdigit():
            index = int(entry)
            if index >= len(gpus):
                break  # CUDA ignores this entry and every one after it
            nodes.append(gpus[index][1])
        else:  # a UUID or its prefix (MIG devices are not listed: their node is unknown)
            matches = [node for uuid, node in gpus if uuid and uuid.startswith(entry)]
            nodes.append(matches[0] if len(matches) == 1 else -1)
    return tuple(nodes)


def _physical_cores(cpus: list[int], sys_root: Path) -> tuple[tuple[int, ...], ...]:
    cores = set()
    for cpu in cpus:
        siblings = sys_root / f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        if siblings.is_file():
            cores.add(tuple(parse_cpulist(siblings.read_text())))
    return tuple(sorted(cores))


def _node_sockets(node_cpus: Mapping[int, tuple[int, ...]], sys_root: Path) -> dict[int, int]:
    sockets = {}
    for node, cpus in node_cpus.items():
        if not cpus:
            continue  # a memory-only node
        package = sys_root / f"devices/system/cpu/cpu{cpus[0]}/topology/physical_package_id"
        if package.is_file():
            sockets[node] = int(package.read_text())
    return sockets


def allowed_cpus(sys_root: Path = SYS, proc_root: Path = PROC) -> frozenset[int]:
    """The CPUs of this process's cpuset cgroup (v2, then v1), else its affinity mask."""
    try:
        lines = (proc_root / "self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        relative = path.lstrip("/")
        if hierarchy == "0" and not controllers:
            candidate = sys_root / "fs/cgroup" / relative / "cpuset.cpus.effective"
        elif "cpuset" in controllers.split(","):
            candidate = sys_root / "fs/cgroup/cpuset" / relative / "cpuset.effective_cpus"
        else:
            continue
        try:
            cpus = parse_cpulist(candidate.read_text())
        except (OSError, ValueError):
            continue
        if cpus:
            return frozenset(cpus)
    return frozenset(os.sched_getaffinity(0))
