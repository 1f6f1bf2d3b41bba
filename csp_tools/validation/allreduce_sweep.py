"""The built-in interconnect test, for nodes without nccl-tests' `all_reduce_perf`: under srun
(one task per GPU, or one per node on nodes without GPUs), an all-reduce over a sweep of sizes
through torch.distributed (NCCL on GPUs, gloo otherwise), timed as nccl-tests times it.

    srun -w node1,node2 --ntasks-per-node=1 python3 -m csp_tools.validation.allreduce_sweep \\
        --min-bytes 1M --max-bytes 256M

Rank 0 prints one JSON line per size: size_bytes, seconds (the slowest rank's mean time of one
all-reduce), ranks, algbw_gbps, busbw_gbps, and the ranks' hosts. The rendezvous is the first
node of the job (MASTER_ADDR, else `scontrol show hostnames`) at MASTER_PORT (else a port made
from the job id); it gives up after --timeout seconds with one line naming the address.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

from csp_tools.validation.bandwidth import Measurement

UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
ONE_RANK = (
    "1 rank: an all-reduce measures a link between 2 ranks or more; run it on 2 nodes or more "
    "(srun -w NODE1,NODE2 ...), or with a task per GPU"
)


def size(text: str) -> int:
    """'64M' -> 67108864 bytes (K, M, G are powers of 2, as nccl-tests reads them)."""
    text = text.strip().upper()
    unit = text[-1] if text and text[-1] in UNITS else ""
    try:
        value = int(text[: len(text) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 8M or 1G") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be positive")
    return value * UNITS[unit]


def sizes(smallest: int, largest: int, factor: int) -> list[int]:
    """smallest, smallest x factor, ... up to largest, each a whole number of float32 values."""
    found, current = [], smallest
    while current <= largest:
        found.append(max(4, current - current % 4))
        current *= factor
    return found


def rendezvous_address() -> tuple[str, int]:
    master = os.environ.get("MASTER_ADDR")
    if not master:
        nodes = subprocess.run(
            ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        master = nodes[0]
    port = int(os.environ.get("MASTER_PORT") or 20000 + int(os.environ["SLURM_JOB_ID"]) % 20000)
    return master, port


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="allreduce_sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--min-bytes", type=size, default=size("1M"))
    parser.add_argument("--max-bytes", type=size, default=size("256M"))
    parser.add_argument("--factor", type=int, default=4, help="each size is this x the last")
    parser.add_argument("--iters", type=int, default=5, help="timed all-reduces per size")
    parser.add_argument("--warmup", type=int, default=2, help="untimed all-reduces per size")
    parser.add_argument("--timeout", type=float, default=120, help="seconds for the rendezvous")
    args = parser.parse_args(argv)
    if args.min_bytes > args.max_bytes:
        parser.error("--min-bytes is larger than --max-bytes")
    if args.factor < 2 or args.iters < 1 or args.warmup < 0:
        parser.error("--factor must be 2 or more, --iters 1 or more, --warmup 0 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    if world < 2:
        # One rank all-reduces with nothing: its busbw is 0 whatever the link.
        print(f"allreduce_sweep: {ONE_RANK}", file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("SLURM_LOCALID", "0")))
    device = torch.device("cuda") if on_gpu else torch.device("cpu")
    master, port = rendezvous_address()
    try:
        dist.init_process_group(
            "nccl" if on_gpu else "gloo",
            init_method=f"tcp://{master}:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=args.timeout),
        )
    except Exception as error:  # noqa: BLE001  (any rendezvous failure is this one line)
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(
            f"allreduce_sweep: rank {rank} on {socket.gethostname()} could not join {world} ranks "
            f"at {master}:{port} within {args.timeout:g} s: {first}",
            file=sys.stderr,
        )
        return 2
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    for nbytes in sizes(args.min_bytes, args.max_bytes, args.factor):
        data = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        for _ in range(args.warmup):
            dist.all_reduce(data)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(data)
        if on_gpu:
            torch.cuda.synchronize()
        elapsed = torch.tensor([(time.perf_counter() - start) / args.iters], device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the collective is as fast as its slowest
        if rank == 0:
            measured = Measurement(nbytes, float(elapsed.item()), world)
            record = {
                "size_bytes": nbytes,
                "seconds": measured.seconds,
                "ranks": world,
                "algbw_gbps": measured.algbw_gbps,
                "busbw_gbps": measured.busbw_gbps,
                "hosts": hosts,
            }
            print(json.dumps(record), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
