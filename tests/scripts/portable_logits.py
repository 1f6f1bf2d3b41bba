"""Logits of our model built from a portable file, on one process:

python -m tests.scripts.portable_logits MODEL.nemo TOKENS.pt OUT.pt
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    model_file, tokens_file, output = (Path(a) for a in sys.argv[1:4])
    dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
    from megatron.core import parallel_state

    from launcher_scripts.formats import portable
    from launcher_scripts.jobs.conversion import load
    from launcher_scripts.jobs.training import cpu_compat

    cpu_compat.patch_cuda_queries()
    cpu_compat.CudaDevicesOnCpu().__enter__()
    parallel_state.initialize_model_parallel(1, 1)
    cpu_compat.install()
    cpu_compat.seed_model_parallel_rngs(1)
    chunks = load.build(portable.read(model_file, Path(tempfile.mkdtemp())), 1, 1, on_gpu=False)
    tokens = torch.load(tokens_file)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        torch.save(chunks[0](tokens, positions, None), output)


if __name__ == "__main__":
    main()
