"""Who this process is (torchrun or Slurm), the process group, megatron-core's parallel state."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

# process_info is part of this module's interface (the job programs call runtime.process_info).
from launcher_scripts.errors import JobError  # noqa: F401  (the job programs' name for it)
from launcher_scripts.jobs.process import ProcessInfo, process_info  # noqa: F401
from launcher_scripts.jobs.training import cpu_compat
from launcher_scripts.ports import free_port
from launcher_scripts.recipes.layout import Layout

COLLECTIVE_TIMEOUT_MINUTES = 30


def start_job(cfg: Any) -> tuple[bool, ProcessInfo]:
    """A job program's start: whether it runs on GPUs (the recipe's accelerator, and CUDA is
    there) and this process's place in the job; on CPU, CUDA's queries answered for the CPU."""
    on_gpu = str(cfg.trainer.get("accelerator", "gpu")) != "cpu" and torch.cuda.is_available()
    info = process_info()
    if not on_gpu:
        cpu_compat.patch_cuda_queries()
        cpu_compat.CudaDevicesOnCpu().__enter__()
    return on_gpu, info


def init_distributed(info: ProcessInfo, on_gpu: bool, rendezvous_timeout: float) -> None:
    """Join the process group, or raise JobError once `rendezvous_timeout` seconds have passed
    without every process of the job (a node that never started, a wrong MASTER_ADDR)."""
    if info.launcher == "single":
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port("127.0.0.1")))
    elif "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise JobError(
            "MASTER_ADDR and MASTER_PORT are not set: start the job with torchrun, or with srun "
            "from a script that exports them (the launcher's Slurm scripts do)"
        )
    if on_gpu:
        torch.cuda.set_device(info.local_rank)
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    print(
        f"{describe_launch(info, on_gpu)}: joining {info.world_size} processes at "
        f"{address}:{port} (up to {rendezvous_timeout:.0f} s)",
        flush=True,
    )
    store = None
    if info.launcher == "slurm":
        # torchrun has formed the group before the program starts; with srun alone the program
        # meets its peers itself, on a store whose wait is bounded.
        try:
            store = dist.TCPStore(
                address,
                port,
                info.world_size,
                is_master=info.rank == 0,
                timeout=timedelta(seconds=rendezvous_timeout),
                wait_for_workers=True,
            )
        except dist.DistError as error:
            raise JobError(
                f"rank {info.rank}: not all {info.world_size} processes joined at "
                f"{address}:{port} within {rendezvous_timeout:.0f} s ({_first_line(error)}). "
                "Check that every node started and can reach the first node on that port, or "
                "raise run.rendezvous_timeout_seconds"
            ) from None
    dist.init_process_group(
        backend="nccl" if on_gpu else "gloo",
        rank=info.rank,
        world_size=info.world_size,
        store=store,
        # Collectives may wait much longer than the rendezvous (a checkpoint written by one rank).
        timeout=timedelta(minutes=COLLECTIVE_TIMEOUT_MINUTES),
    )


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def init_model_parallel(layout: Layout, seed: int, on_gpu: bool) -> None:
    if layout.world_size != dist.get_world_size():
        raise JobError(
            f"trainer.num_nodes x trainer.devices: the recipe asks for {layout.world_size} "
            f"processes but {dist.get_world_size()} were started: make them match the launch "
            "(srun's tasks, torchrun's --nnodes x --nproc-per-node)"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor,
        pipeline_model_parallel_size=layout.pipeline,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline,
        context_parallel_size=layout.context,
        expert_model_parallel_size=layout.expert,
        expert_tensor_parallel_size=layout.expert_tensor,
    )
    if on_gpu:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        cpu_compat.install()
        cpu_compat.seed_model_parallel_rngs(seed)


def seed_everything(seed: int) -> None:
    """One seed for every rank: weights initialised on CPU then split are the same at any TP."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def shutdown() -> None:
    if parallel_state.is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def describe_launch(info: ProcessInfo, on_gpu: bool) -> str:
    """One line per rank, printed before it waits for its peers: where a stuck job stands."""
    device = f"cuda:{info.local_rank}" if on_gpu else "cpu"
    return (
        f"rank {info.rank}/{info.world_size} local_rank {info.local_rank} host "
        f"{socket.gethostname()} device {device} launcher {info.launcher}"
    )
