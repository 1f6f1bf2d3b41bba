"""Under torchrun: build the model from a portable file at each given TP/PP and check that every
parameter equals the same model loaded from the original training checkpoint, bit for bit.
Layouts smaller than the world are checked with data parallel ranks filling it, so one launch
(one start-up of every process) checks them all.

    torchrun --nproc-per-node=4 -m tests.scripts.reshard_check MODEL.nemo CHECKPOINT_DIR 2x2 1x1
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> int:
    model_file, checkpoint = Path(sys.argv[1]), Path(sys.argv[2])
    layouts = [tuple(int(size) for size in layout.split("x")) for layout in sys.argv[3:]]
    dist.init_process_group("gloo")
    # The job package first: it keeps megatron-core's import light on CPU.
    from launcher_scripts.formats import portable
    from launcher_scripts.jobs.training import cpu_compat

    cpu_compat.patch_cuda_queries()
    cpu_compat.CudaDevicesOnCpu().__enter__()
    workdir = Path(tempfile.mkdtemp(prefix=f"rank{dist.get_rank()}-"))
    loaded = portable.read(model_file, workdir)
    failed = False
    for tensor, pipeline in layouts:
        failed |= check(loaded, checkpoint, tensor, pipeline)
    dist.destroy_process_group()
    return 1 if failed else 0


def check(loaded: object, checkpoint: Path, tensor: int, pipeline: int) -> bool:
    """Whether any parameter differs at this layout (printed, one line per rank)."""
    from megatron.core import dist_checkpointing, parallel_state

    from launcher_scripts.jobs.conversion import load
    from launcher_scripts.jobs.training import cpu_compat

    parallel_state.initialize_model_parallel(tensor, pipeline)
    cpu_compat.install()
    cpu_compat.seed_model_parallel_rngs(1)
    from_portable = load.build(loaded, tensor, pipeline, on_gpu=False)[0]
    reference = load.build(loaded, tensor, pipeline, on_gpu=False)[0]
    for parameter in reference.parameters():
        parameter.data.zero_()
    state = dist_checkpointing.load(
        {"model": reference.sharded_state_dict()}, str(checkpoint), strict="assume_ok_unexpected"
    )
    reference.load_state_dict(state["model"], strict=False)
    mismatched = [
        name
        for (name, a), (_, b) in zip(
            from_portable.state_dict().items(), reference.state_dict().items(), strict=True
        )
        if torch.is_tensor(a) and a.is_floating_point() and not torch.equal(a, b)
    ]
    layout = f"{tensor}x{pipeline}"
    rank = os.environ["RANK"]
    print(f"{layout} rank {rank}: {len(mismatched)} mismatched {mismatched[:3]}", flush=True)
    parallel_state.destroy_model_parallel()
    return bool(mismatched)


if __name__ == "__main__":
    sys.exit(main())
