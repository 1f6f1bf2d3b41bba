"""Start a job's program under Nsight Systems on the ranks `model.nsys_profile` lists.

    python3 -u -m launcher_scripts.jobs.profiled --ranks=0 --trace=cuda,nvtx \\
        --output=DIR -- MODULE [ARGS...]

On a listed rank this replaces itself with
    nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop ... python3 -u -m MODULE
so the report (DIR/profile_rank<R>.nsys-rep) holds what the program captures between its
cudaProfilerStart and cudaProfilerStop (the training loop's start and end steps). Other ranks
replace themselves with the program alone. A node without `nsys` stops the job at start-up with
one line, before any work: a profiling run that silently profiled nothing would waste the
allocation. Torch-free, like numa_binding, which may start this.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from launcher_scripts.jobs.process import process_info
from launcher_scripts.jobs.refusal import refuse


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit("usage: profiled --ranks=R,.. --trace=T,.. --output=DIR -- MODULE ...")
    split = list(argv).index("--")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", required=True, help="comma-separated global ranks")
    parser.add_argument("--trace", required=True, help="nsys --trace, comma-separated")
    parser.add_argument("--output", required=True, help="the folder of the reports")
    args = parser.parse_args(argv[:split])
    program = list(argv[split + 1 :])
    if not program:
        raise SystemExit("profiled: no program after --")
    return args, program


def nsys_argv(nsys: str, args: argparse.Namespace, rank: int, program: Sequence[str]) -> list[str]:
    return [
        nsys,
        "profile",
        "--sample=none",
        f"--trace={args.trace}",
        "--capture-range=cudaProfilerApi",
        "--capture-range-end=stop",
        "--force-overwrite=true",
        f"--output={Path(args.output) / f'profile_rank{rank}'}",
        sys.executable,
        "-u",
        "-m",
        *program,
    ]


def main(argv: Sequence[str] | None = None) -> int:
    args, program = parse(sys.argv[1:] if argv is None else argv)
    rank = process_info().rank
    if rank in {int(part) for part in args.ranks.split(",") if part}:
        nsys = shutil.which("nsys")
        if nsys is None:
            return refuse(
                f"training.model.nsys_profile.enabled is true but nsys (Nsight Systems) is not "
                f"on PATH on {socket.gethostname()} (rank {rank}): use a container that has it "
                "(NVIDIA's PyTorch and NeMo images do), or set "
                "training.model.nsys_profile.enabled=false"
            )
        Path(args.output).mkdir(parents=True, exist_ok=True)
        print(f"rank {rank}: profiled by nsys into {args.output}", flush=True)
        os.execv(nsys, nsys_argv(nsys, args, rank, program))
    os.execv(sys.executable, [sys.executable, "-u", "-m", *program])
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
