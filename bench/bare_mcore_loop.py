"""The reference for bench/train_overhead.py: megatron-core's forward/backward/optimizer step
on the training program's model, fed from batches held in memory, with nothing else per step.

    python3 bench/bare_mcore_loop.py --config RECIPE.yaml --steps 60 --warmup 10

The model, DDP wrapper, optimizer and scheduler are built exactly as the training program
builds them (so the two time the same megatron-core objects); only the loop differs.
Prints "seconds_per_step S" for steps warmup+1..steps.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    args = parser.parse_args()

    from omegaconf import OmegaConf

    from launcher_scripts.jobs.training import cpu_compat, runtime
    from launcher_scripts.recipes.training import rendezvous_timeout

    cfg = OmegaConf.load(args.config)
    on_gpu = str(cfg.trainer.get("accelerator", "gpu")) != "cpu" and torch.cuda.is_available()
    if not on_gpu:
        cpu_compat.patch_cuda_queries()
        cpu_compat.CudaDevicesOnCpu().__enter__()
    info = runtime.process_info()
    runtime.init_distributed(info, on_gpu, rendezvous_timeout(cfg))

    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from launcher_scripts.jobs.training.pretrain import StopSignals
    from launcher_scripts.jobs.training.trainer import PretrainingTask, Trainer

    trainer = Trainer(cfg, on_gpu, StopSignals(), PretrainingTask())
    model, optimizer, scheduler = trainer.model, trainer.optimizer, trainer.scheduler
    seq, mbs = int(cfg.model.data.seq_length), int(cfg.model.micro_batch_size)
    micro_batches = get_num_microbatches()
    device = "cuda" if on_gpu else "cpu"
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(
        0, trainer.vocab.vocab_size, (micro_batches, mbs, seq + 1), generator=generator
    )
    batches = [
        {
            "tokens": t[:, :-1].to(device),
            "labels": t[:, 1:].to(device),
            "position_ids": torch.arange(seq).expand(mbs, seq).to(device),
            "loss_mask": torch.ones(mbs, seq, device=device),
        }
        for t in tokens
    ]

    def forward_step(data_iterator, chunk):  # noqa: ANN001, ANN202
        # The family's own forward step (model call and loss), as the training loop calls it.
        return trainer.runtime.forward_step(next(data_iterator), chunk)

    forward_backward = get_forward_backward_func()
    started = 0.0
    for step in range(1, args.steps + 1):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        iterators = [iter(batches) for _ in model]
        forward_backward(
            forward_step_func=forward_step,
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=model,
            num_microbatches=micro_batches,
            seq_length=seq,
            micro_batch_size=mbs,
            forward_only=False,
        )
        optimizer.step()
        scheduler.step(increment=1)
        if on_gpu:
            torch.cuda.synchronize()
        if step == args.warmup:
            started = time.time()
    elapsed = time.time() - started
    if info.rank == 0:
        print(f"seconds_per_step {elapsed / (args.steps - args.warmup)}", flush=True)
    runtime.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
