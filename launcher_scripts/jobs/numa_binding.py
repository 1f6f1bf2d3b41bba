"""Bind each process of a GPU job to CPU cores near its GPU (`numa_mapping`), then run the job.

The scripts of a GPU job that runs one process per GPU start each process as
    python3 -u -m launcher_scripts.jobs.numa_binding --mode=... [options] -- MODULE [ARGS...]
under torchrun, srun, bcprun or in a pod alike. This works out which GPU the process drives (its
local rank, from torchrun's or Slurm's variables: the programs call cuda.set_device(local_rank)),
picks cores for it, sets its CPU affinity, logs one line, and replaces itself with
`python3 -u -m MODULE ARGS`: the affinity is inherited, and the process id stays the program's,
so signals still reach it. A machine that says nothing about NUMA (no GPU driver, no NUMA
nodes) gets one line and no binding.

What each option means follows NVIDIA's gpu_affinity package, which the NeMo launcher's
numa_mapping drives. "Cores" are physical cores (hyperthread siblings count once) among the CPUs
the process may use; GPU i is the GPU of local rank i.
- mode all: every core of the GPU's NUMA node, shared with the node's other GPUs.
  single: the node's first core, shared. single_unique: one core per GPU, the node's first one
  no lower-ranked GPU took. unique_contiguous: the node's cores split among its GPUs in
  contiguous blocks. unique_interleaved: the same counts, dealt out round-robin.
- scope socket: also the cores of the GPU's socket outside its NUMA node. In mode all: every
  core of the socket (the node's first). In the unique modes: the cores of the socket's NUMA
  nodes that have none of the job's GPUs, split among the socket's GPUs the same way. The single
  modes take their one core from the GPU's node in either scope.
- balanced (unique modes): every GPU gets as many cores as the smallest share of any node (of
  any socket, for the extra socket cores); false: each node's cores are split evenly among its
  GPUs, so GPUs on different nodes may get different counts.
- min_cores: a GPU with fewer cores is an error (the job stops with one line). max_cores: the
  first max_cores cores are kept (null: all). The single modes give one core, whatever these say.
- cores all_logical: every hyperthread of each chosen core; single_logical: its first one.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from launcher_scripts.jobs.numa_topology import (
    NoNumaInformation,
    Topology,
    format_cpulist,
    read_topology,
)
from launcher_scripts.jobs.process import process_info
from launcher_scripts.recipes.numa import CORES, MODES, SCOPES, NumaPolicy

EXIT_BAD_BINDING = 2

Core = tuple[int, ...]  # the logical CPUs of one physical core


class BindingError(Exception):
    """The settings cannot be met on this machine (too few cores for min_cores, say)."""


@dataclass(frozen=True)
class Binding:
    gpu: int
    node: int
    physical_cores: int
    cpus: tuple[int, ...]


def select_cpus(
    topology: Topology, policy: NumaPolicy, local_rank: int, local_ranks: int
) -> Binding:
    """The CPUs for the process of `local_rank` among `local_ranks` on this node, one GPU each.

    NoNumaInformation when a GPU's NUMA node is unknown; BindingError when the settings cannot
    be met."""
    if not 0 <= local_rank < local_ranks:
        raise NoNumaInformation(f"local rank {local_rank} is not one of the {local_ranks} per node")
    nodes = _gpu_nodes(topology, local_ranks)
    node = nodes[local_rank]
    cores_of = _cores_by_node(topology)
    own = cores_of.get(node, [])
    if policy.mode in ("single", "single_unique"):
        chosen = _single(cores_of, nodes, local_rank, policy.mode == "single_unique")
    else:
        if policy.mode == "all":
            chosen = list(own)
            if policy.scope == "socket":
                chosen += _socket_cores(topology, cores_of, node, exclude={node})
        else:
            chosen = _unique_share(cores_of, nodes, local_rank, policy)
            if policy.scope == "socket":
                chosen += _unique_socket_share(topology, cores_of, nodes, local_rank, policy)
        if len(chosen) < policy.min_cores:
            raise BindingError(
                f"GPU {local_rank} (NUMA node {node}) gets {len(chosen)} physical cores in mode "
                f"{policy.mode}, scope {policy.scope}, fewer than numa_mapping.min_cores="
                f"{policy.min_cores} (its node has {len(own)} that this process may use, for "
                f"{nodes.count(node)} GPUs). Lower numa_mapping.min_cores, use another mode, "
                "or set numa_mapping.enable=false"
            )
        if policy.max_cores is not None:
            chosen = chosen[: policy.max_cores]
    cpus = [cpu for core in chosen for cpu in (core if policy.cores == "all_logical" else core[:1])]
    return Binding(local_rank, node, len(chosen), tuple(sorted(cpus)))


def _gpu_nodes(topology: Topology, local_ranks: int) -> list[int]:
    if local_ranks > len(topology.gpu_nodes):
        raise NoNumaInformation(
            f"this process sees {len(topology.gpu_nodes)} GPUs, fewer than the job's "
            f"{local_ranks} processes per node"
        )
    nodes = list(topology.gpu_nodes[:local_ranks])
    unknown = [gpu for gpu, node in enumerate(nodes) if node not in topology.node_cpus]
    if unknown:
        raise NoNumaInformation(f"the NUMA node of GPU {unknown[0]} is unknown")
    return nodes


def _cores_by_node(topology: Topology) -> dict[int, list[Core]]:
    """Each node's physical cores (their CPUs the process may use), by lowest CPU."""
    core_of = {cpu: core for core in topology.cores for cpu in core}
    by_node: dict[int, list[Core]] = {}
    for node, cpus in topology.node_cpus.items():
        groups: dict[Core, list[int]] = {}
        for cpu in sorted(cpus):
            if topology.allowed is None or cpu in topology.allowed:
                groups.setdefault(core_of.get(cpu, (cpu,)), []).append(cpu)
        by_node[node] = [tuple(members) for members in groups.values()]
    return by_node


def _single(
    cores_of: dict[int, list[Core]], nodes: list[int], rank: int, unique: bool
) -> list[Core]:
    """single: the first core of the GPU's node; single_unique: the first one no GPU of a lower
    rank took."""
    taken: set[Core] = set()
    for gpu in range(rank + 1) if unique else (rank,):
        node = nodes[gpu]
        free = [core for core in cores_of.get(node, []) if core not in taken]
        if not free:
            raise BindingError(
                f"NUMA node {node} has no core left for GPU {gpu}: it has "
                f"{len(cores_of.get(node, []))} that this process may use, for "
                f"{nodes.count(node)} GPUs in mode {'single_unique' if unique else 'single'}. "
                "Use another numa_mapping.mode, or set numa_mapping.enable=false"
            )
        taken.add(free[0])
    return [free[0]]


def _split(pool: list[Core], members: int, index: int, count: int, mode: str) -> list[Core]:
    """Member `index` of `members`' share of `pool`, `count` cores each."""
    pool = pool[: count * members]
    if mode == "unique_interleaved":
        return pool[index::members]
    return pool[index * count : (index + 1) * count]


def _unique_share(
    cores_of: dict[int, list[Core]], nodes: list[int], rank: int, policy: NumaPolicy
) -> list[Core]:
    members = {node: [gpu for gpu, n in enumerate(nodes) if n == node] for node in set(nodes)}
    counts = {node: len(cores_of.get(node, [])) // len(gpus) for node, gpus in members.items()}
    node = nodes[rank]
    count = min(counts.values()) if policy.balanced else counts[node]
    return _split(
        cores_of.get(node, []), len(members[node]), members[node].index(rank), count, policy.mode
    )


def _socket_of(topology: Topology, node: int) -> tuple[str, int]:
    if node in topology.node_sockets:
        return ("socket", topology.node_sockets[node])
    return ("node", node)


def _socket_cores(
    topology: Topology, cores_of: dict[int, list[Core]], node: int, exclude: set[int]
) -> list[Core]:
    """The cores of `node`'s socket on its other nodes (less those in `exclude`)."""
    socket = _socket_of(topology, node)
    others = [
        core
        for other, cores in cores_of.items()
        if other not in exclude and _socket_of(topology, other) == socket
        for core in cores
    ]
    return sorted(others)


def _unique_socket_share(
    topology: Topology,
    cores_of: dict[int, list[Core]],
    nodes: list[int],
    rank: int,
    policy: NumaPolicy,
) -> list[Core]:
    """The rank's share of its socket's cores on nodes without any of the job's GPUs."""
    sockets = [_socket_of(topology, node) for node in nodes]
    members = {s: [gpu for gpu, other in enumerate(sockets) if other == s] for s in set(sockets)}
    extra = {
        s: _socket_cores(topology, cores_of, nodes[gpus[0]], exclude=set(nodes))
        for s, gpus in members.items()
    }
    counts = {s: len(extra[s]) // len(gpus) for s, gpus in members.items()}
    socket = sockets[rank]
    count = min(counts.values()) if policy.balanced else counts[socket]
    return _split(
        extra[socket], len(members[socket]), members[socket].index(rank), count, policy.mode
    )


# ----- the wrapper ------------------------------------------------------------------------------


def _bool(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return text.lower() == "true"


def _max_cores(text: str) -> int | None:
    return None if text.lower() in ("null", "none") else int(text)


def parse(argv: Sequence[str]) -> tuple[NumaPolicy, int, list[str]]:
    """(policy, local ranks, the program's module and arguments) from the wrapper's argv."""
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        raise SystemExit("usage: numa_binding [options] -- MODULE [ARGS...]")
    split = list(argv).index("--")
    parser = argparse.ArgumentParser(prog="python3 -m launcher_scripts.jobs.numa_binding")
    parser.add_argument("--mode", choices=MODES, default="unique_contiguous")
    parser.add_argument("--scope", choices=SCOPES, default="node")
    parser.add_argument("--cores", choices=CORES, default="all_logical")
    parser.add_argument("--balanced", type=_bool, default=True)
    parser.add_argument("--min-cores", type=int, default=1)
    parser.add_argument("--max-cores", type=_max_cores, default=None)
    parser.add_argument("--local-ranks", type=int, required=True)
    options = parser.parse_args(argv[:split])
    policy = NumaPolicy(
        options.mode,
        options.scope,
        options.cores,
        options.balanced,
        options.min_cores,
        options.max_cores,
    )
    return policy, options.local_ranks, list(argv[split + 1 :])


def bind(policy: NumaPolicy, local_ranks: int, topology: Topology | None = None) -> str | None:
    """Bind this process; returns the line to log (None: nothing to say from this rank)."""
    local_rank = process_info().local_rank
    try:
        if topology is None:
            topology = read_topology(os.environ.get("CUDA_VISIBLE_DEVICES"))
        binding = select_cpus(topology, policy, local_rank, local_ranks)
    except NoNumaInformation as reason:
        # One line for the node, not one per process: it says the same for every rank.
        return f"numa_mapping: not binding: {reason}" if local_rank == 0 else None
    try:
        os.sched_setaffinity(0, binding.cpus)
    except OSError as error:  # CPUs outside what the process may use after all
        return f"numa_mapping: local rank {local_rank}: not binding: {error}"
    return (
        f"numa_mapping: local rank {local_rank}: GPU {binding.gpu} on NUMA node {binding.node}: "
        f"{binding.physical_cores} physical cores, CPUs {format_cpulist(binding.cpus)} "
        f"({policy.mode}, scope {policy.scope}, {policy.cores})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    policy, local_ranks, program = parse(sys.argv[1:] if argv is None else argv)
    try:
        line = bind(policy, local_ranks)
    except BindingError as error:
        print(f"error: numa_mapping: {error}", file=sys.stderr, flush=True)
        return EXIT_BAD_BINDING
    if line:
        print(line, flush=True)
    python = sys.executable or "python3"
    os.execv(python, [python, "-u", "-m", *program])
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
