"""tests/scripts/reshard_check.py for several portable files in one launch (one start-up of
every process for all of them): groups of MODEL.nemo CHECKPOINT_DIR LAYOUT..., separated by --.
Each result line is reshard_check's, prefixed with its group's number and a colon.

    torchrun --nproc-per-node=2 -m tests.scripts.reshard_checks A.nemo A_CKPT 2x1 1x1 -- \
        B.nemo B_CKPT 1x1
"""

from __future__ import annotations

import contextlib
import io
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist


def groups(argv: list[str]) -> list[tuple[Path, Path, list[tuple[int, int]]]]:
    found, current = [], []
    for arg in [*argv, "--"]:
        if arg != "--":
            current.append(arg)
            continue
        model, checkpoint, *layouts = current
        sizes = [tuple(int(size) for size in layout.split("x")) for layout in layouts]
        found.append((Path(model), Path(checkpoint), sizes))
        current = []
    return found


def main() -> int:
    checks = groups(sys.argv[1:])
    dist.init_process_group("gloo")
    # The job package first: it keeps megatron-core's import light on CPU.
    from launcher_scripts.formats import portable
    from launcher_scripts.jobs.training import cpu_compat
    from tests.scripts.reshard_check import check

    cpu_compat.patch_cuda_queries()
    cpu_compat.CudaDevicesOnCpu().__enter__()
    failed = False
    for number, (model_file, checkpoint, layouts) in enumerate(checks):
        workdir = Path(tempfile.mkdtemp(prefix=f"rank{dist.get_rank()}-"))
        loaded = portable.read(model_file, workdir)
        for tensor, pipeline in layouts:
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                failed |= check(loaded, checkpoint, tensor, pipeline)
            for line in printed.getvalue().splitlines():
                print(f"{number}: {line}", flush=True)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
