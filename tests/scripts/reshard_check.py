"""Under torchrun: build the model from a portable file at each given TP/PP and check that every
parameter equals the same model loaded from the original training checkpoint, bit for bit.
Layouts smaller than the world are checked with data parallel ranks filling it, so one launch
(one start-up of every process) checks them all, for several portable files too: groups of
MODEL.nemo CHECKPOINT_DIR LAYOUT..., separated by --. Each result line starts with its group's
number and a colon.

    torchrun --nproc-per-node=4 -m tests.scripts.reshard_check MODEL.nemo CHECKPOINT_DIR 2x2 1x1
    torchrun --nproc-per-node=2 -m tests.scripts.reshard_check A.nemo A_CK 2x1 -- B.nemo B_CK 1x1

With `--logits MODEL INPUTS.pt OUT.pt [MODEL INPUTS OUT ...]` after the groups, the same
launch then computes what tests/scripts/portable_logits.py computes for each model, at TP1 x PP1
on rank 0 (the other ranks data parallel, idle): that saves that script's own start-up.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist


def groups(argv: list[str]) -> list[tuple[Path, Path, list[tuple[int, int]]]]:
    """(model file, checkpoint, layouts) of each group of the command line."""
    found, current = [], []
    for arg in [*argv, "--"]:
        if arg != "--":
            current.append(arg)
            continue
        model_file, checkpoint, *layouts = current
        sizes = [tuple(int(size) for size in layout.split("x")) for layout in layouts]
        found.append((Path(model_file), Path(checkpoint), sizes))
        current = []
    return found


def main() -> int:
    argv = sys.argv[1:]
    logits = argv[argv.index("--logits") + 1 :] if "--logits" in argv else []
    argv = argv[: argv.index("--logits")] if "--logits" in argv else argv
    assert len(logits) % 3 == 0, __doc__
    checks = groups(argv)
    dist.init_process_group("gloo")
    # The job package first: it keeps megatron-core's import light on CPU.
    from launcher_scripts.formats import portable
    from launcher_scripts.jobs.training import cpu_compat

    cpu_compat.patch_cuda_queries()
    cpu_compat.CudaDevicesOnCpu().__enter__()
    workdir = Path(tempfile.mkdtemp(prefix=f"rank{dist.get_rank()}-"))
    failed = False
    for number, (model_file, checkpoint, layouts) in enumerate(checks):
        loaded = portable.read(model_file, workdir / str(number))
        for tensor, pipeline in layouts:
            failed |= check(loaded, checkpoint, tensor, pipeline, f"{number}: ")
    for at in range(0, len(logits), 3):
        compute_logits(*(Path(a) for a in logits[at : at + 3]), workdir)
    dist.destroy_process_group()
    return 1 if failed else 0


def check(loaded: object, checkpoint: Path, tensor: int, pipeline: int, prefix: str) -> bool:
    """Whether any parameter differs at this layout (printed after `prefix`, one line per
    rank)."""
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
        {"model": reference.sharded_state_dict()},
        str(checkpoint),
        strict="assume_ok_unexpected",
    )
    reference.load_state_dict(state["model"], strict=False)
    mismatched = [
        name
        for (name, a), (_, b) in zip(
            from_portable.state_dict().items(),
            reference.state_dict().items(),
            strict=True,
        )
        if torch.is_tensor(a) and a.is_floating_point() and not torch.equal(a, b)
    ]
    layout = f"{tensor}x{pipeline}"
    rank = os.environ["RANK"]
    line = f"{prefix}{layout} rank {rank}: {len(mismatched)} mismatched {mismatched[:3]}\n"
    # One write per line: every rank shares the pipe, and print() under PYTHONUNBUFFERED=1
    # writes the text and its newline apart, so two ranks' lines could run together.
    os.write(sys.stdout.fileno(), line.encode())
    parallel_state.destroy_model_parallel()
    return bool(mismatched)


def compute_logits(model_file: Path, inputs_file: Path, output: Path, workdir: Path) -> None:
    """portable_logits.py's outputs of the model on the inputs, at TP1 x PP1, written by rank 0
    (the other ranks, data parallel, only join the groups)."""
    from megatron.core import parallel_state

    from launcher_scripts.formats import portable
    from launcher_scripts.jobs.conversion import load
    from launcher_scripts.jobs.training import cpu_compat
    from tests.scripts.portable_logits import outputs

    parallel_state.initialize_model_parallel(1, 1)
    cpu_compat.install()
    cpu_compat.seed_model_parallel_rngs(1)
    if dist.get_rank() == 0:  # a TP1 x PP1 model's build and forward pass talk to no rank
        folder = workdir / output.stem
        folder.mkdir()
        chunks = load.build(portable.read(model_file, folder), 1, 1, on_gpu=False)
        with torch.no_grad():
            torch.save(outputs(chunks[0], torch.load(inputs_file)), output)
    parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    sys.exit(main())
