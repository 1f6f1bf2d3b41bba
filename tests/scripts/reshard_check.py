"""Under torchrun: build the model from a portable file at this run's TP/PP and check that every
parameter equals the same model loaded from the original training checkpoint, bit for bit.

    torchrun --nproc-per-node=4 -m tests.scripts.reshard_check MODEL.nemo CHECKPOINT_DIR TP PP
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
    tensor, pipeline = int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo")
    from megatron.core import dist_checkpointing, parallel_state

    from launcher_scripts.formats import portable
    from launcher_scripts.jobs.conversion import load
    from launcher_scripts.jobs.training import cpu_compat

    cpu_compat.patch_cuda_queries()
    cpu_compat.CudaDevicesOnCpu().__enter__()
    parallel_state.initialize_model_parallel(tensor, pipeline)
    cpu_compat.install()
    cpu_compat.seed_model_parallel_rngs(1)
    workdir = Path(tempfile.mkdtemp(prefix=f"rank{dist.get_rank()}-"))
    loaded = portable.read(model_file, workdir)
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
    print(f"rank {os.environ['RANK']}: {len(mismatched)} mismatched {mismatched[:3]}", flush=True)
    dist.destroy_process_group()
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
