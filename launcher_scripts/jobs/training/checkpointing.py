"""Distributed checkpoints that are complete or invisible, retention, and resume.

A checkpoint is written by every rank into `checkpoints/.tmp-<name>` with megatron-core's
distributed checkpointing, then rank 0 adds `train_state.json` (step, consumed samples,
scheduler, metrics) and renames the folder to `<name>`. A rename is atomic, so a crash at any
point leaves either a finished checkpoint or a `.tmp-` folder; a folder without
`train_state.json` is never resumed from. Model and optimizer state are sharded by megatron-core,
so a run can resume at a different data-parallel size.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import re
import shutil
import signal
from collections.abc import Iterator
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.tensor_parallel import random as mcore_random

from launcher_scripts.formats.progress import (
    STATE_FILE,
    STOP_SIGNALS,
    TMP_PREFIX,
    Checkpoint,
    TrainState,
    complete_checkpoints,
)
from launcher_scripts.jobs.training import mcore_mends

RNG_DIR = "rng_state"
# dp_reshardable: every rank writes its own optimizer shard in parallel, and the checkpoint
# loads at any data-parallel size. A MoE model's expert-parallel size changes how its experts'
# optimizer state is bucketed, so its optimizer is saved per parameter instead (gathered on
# each data-parallel group's first rank): it loads at any EP.
OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}
EXPERTS_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}
# A template field and the "-" that follows it, which goes with the field when it is left out.
FIELD = re.compile(r"\{(\w+)(:[^}]*)?\}(-?)")


def checkpoint_name(template: str, values: dict[str, float]) -> str:
    """Lightning's file-name template: "{val_loss:.2f}" becomes "val_loss=2.34".

    A metric with no value yet (val_loss before the first validation) is left out of the name
    with its separator, "megatron_gpt--step=5-consumed_samples=40.0": "val_loss=nan" read as a
    diverged run, and Lightning's 0 in its place as a perfect one."""

    def replace(match: re.Match[str]) -> str:
        name, spec, separator = match.group(1), (match.group(2) or ":")[1:], match.group(3)
        value = values.get(name)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return ""
        return f"{name}={format(value, spec)}{separator}"

    return FIELD.sub(replace, template).rstrip("-") or "checkpoint"


def _world() -> dict[str, int]:
    return {
        "world_size": dist.get_world_size(),
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
    }


def _rng_state() -> dict[str, Any]:
    import random

    import numpy as np

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": {
            name: value.clone()
            for name, value in mcore_random.get_cuda_rng_tracker().get_states().items()
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    mcore_random.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def unwrap(chunk: Any) -> Any:
    """The GPTModel inside the DDP and mixed-precision wrappers.

    Its keys ("decoder.layers.0...") are the checkpoint's, whatever wrapped the model in
    training, so conversion and evaluation read checkpoints without knowing the wrappers.
    """
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


# Models a task trains beside the main one (PPO's critic), by name: (model chunks, optimizer).
Beside = dict[str, tuple[list[Any], Any]]


def _model_state(model: list[Any], prefix: str) -> dict[str, Any]:
    chunks = [unwrap(chunk) for chunk in model]
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict(prefix=prefix)}
    return {f"model{i}": chunk.sharded_state_dict(prefix=prefix) for i, chunk in enumerate(chunks)}


def _optimizer_format(model: list[Any]) -> dict[str, str]:
    experts = any(
        not getattr(param, "allreduce", True) for chunk in model for param in chunk.parameters()
    )
    if not experts:
        return OPTIMIZER_FORMAT
    mcore_mends.torch_adam_resumes_per_parameter()
    return EXPERTS_OPTIMIZER_FORMAT


def sharded_state(
    model: list[Any], optimizer: Any, is_loading: bool, beside: Beside | None = None
) -> dict[str, Any]:
    """The checkpoint's sharded state: the model and its optimizer, and each model trained
    beside it with its optimizer under its name (its tensors' keys prefixed `<name>.`)."""
    state = _model_state(model, "")
    state["optimizer"] = optimizer.sharded_state_dict(
        state, is_loading=is_loading, metadata=_optimizer_format(model)
    )
    for name, (other, other_optimizer) in (beside or {}).items():
        part = _model_state(other, f"{name}.")
        part["optimizer"] = other_optimizer.sharded_state_dict(
            part, is_loading=is_loading, metadata=_optimizer_format(other)
        )
        state[name] = part
    return state


def _load_models(model: list[Any], loaded: dict[str, Any]) -> None:
    if len(model) == 1:
        unwrap(model[0]).load_state_dict(loaded["model"])
    else:
        for i, chunk in enumerate(model):
            unwrap(chunk).load_state_dict(loaded[f"model{i}"])


def _strip(state: dict[str, Any], prefix: str) -> dict[str, Any]:
    """A loaded state dict's keys without the prefix they were saved under."""
    return {key.removeprefix(prefix): value for key, value in state.items()}


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """Hold SIGTERM/SIGUSR1 (pending, not lost) while a checkpoint is written.

    megatron-core writes through processes this one forks at each save. They share this
    rank's process group, which torchrun, srun and Kubernetes signal as a whole; killed
    there, they would fail the very save the signal asks for (BrokenPipeError, a torn `.tmp-`
    folder). Processes started meanwhile inherit the blocked signals and so keep writing; the
    rank itself gets its signal when the save is done, and stops after the step as documented.
    """
    # Python starts its resource tracker with the first spawned process and unblocks SIGTERM
    # right after (bpo-33613): started now, it cannot undo the block below.
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _write_results_in_process() -> None:
    """megatron-core's writer passes its write results back through a queue it creates once
    per process from a spawned Manager: a second interpreter that imports this job's main
    module again (torch, megatron-core: seconds of CPU on every rank at its first save).
    Our saves are synchronous (`dist_checkpointing.save` runs the write in this process), so
    the results never leave it, and an in-process queue carries them."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save(
    directory: Path,
    name: str,
    model: list[Any],
    optimizer: Any,
    train_state: TrainState,
    beside: Beside | None = None,
) -> Path:
    """Write a checkpoint atomically; every rank calls this."""
    _write_results_in_process()
    with stop_signals_held():
        return _save(directory, name, model, optimizer, train_state, beside)


def _save(
    directory: Path,
    name: str,
    model: list[Any],
    optimizer: Any,
    train_state: TrainState,
    beside: Beside | None,
) -> Path:
    final, tmp = directory / name, directory / f"{TMP_PREFIX}{name}"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(sharded_state(model, optimizer, False, beside), str(tmp))
    (tmp / RNG_DIR).mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / RNG_DIR / f"rank_{rank:05d}.pt")
    dist.barrier()
    sizes = _gather_file_sizes(tmp, rank)
    if rank == 0:
        train_state.world = _world()
        train_state.files = sizes
        _write_json(tmp / STATE_FILE, train_state.__dict__)
        if final.exists():  # the same step saved again, e.g. at a signal right after a save
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(directory)
    dist.barrier()
    return final


# The files a rank writes itself: its shards of torch's distributed checkpoint format and its
# RNG states. Rank 0 writes the rest (metadata, common state).
_RANK_FILES = (re.compile(r"__(\d+)_\d+\.distcp"), re.compile(rf"{RNG_DIR}/rank_(\d+)\.pt"))


def _writer_rank(name: str) -> int:
    for pattern in _RANK_FILES:
        match = pattern.fullmatch(name)
        if match:
            return int(match.group(1))
    return 0


def _gather_file_sizes(folder: Path, rank: int) -> dict[str, int]:
    """Every file of the checkpoint being saved and its size, as the rank that wrote it sees
    it (on a network file system another node may see an older size for a while): on rank 0;
    empty elsewhere. Resume and conversion compare them to find a file cut short later."""
    mine = {
        path.relative_to(folder).as_posix(): path.stat().st_size
        for path in folder.rglob("*")
        if path.is_file() and _writer_rank(path.relative_to(folder).as_posix()) == rank
    }
    gathered: list[Any] = [None] * dist.get_world_size() if rank == 0 else []
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    return {name: size for part in gathered for name, size in part.items()} if rank == 0 else {}


def _write_json(path: Path, value: Any) -> None:
    with open(path, "w") as handle:
        json.dump(value, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _torch_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers inside megatron-core's (possibly chained) optimizer."""
    return [inner.optimizer for inner in getattr(optimizer, "chained_optimizers", [optimizer])]


@torch.no_grad()
def _materialize_optimizer_state(optimizer: Any) -> None:
    """Give every parameter its Adam state (with a step count) before a load fills it in.

    megatron-core's loader reads the state's structure from the live optimizer; without Apex
    or Transformer Engine, torch's Adam creates it only in its first step. A step on zero
    gradients creates it; every value it touches is then overwritten by the checkpoint.
    """
    for torch_optimizer in _torch_optimizers(optimizer):
        params = [p for group in torch_optimizer.param_groups for p in group["params"]]
        if all(torch_optimizer.state.get(p) for p in params):
            continue
        for param in params:
            param.grad = torch.zeros_like(param)
        torch_optimizer.step()
        torch_optimizer.zero_grad()


def _restore_adam_steps(optimizer: Any) -> None:
    """Put the checkpoint's step count back into torch Adam's per-parameter state.

    Without Apex or Transformer Engine, megatron-core keeps the count in the param groups of
    the checkpoint but leaves the per-parameter "step" that torch's Adam reads for its bias
    correction at the value the live optimizer had; a resumed run would then update
    differently from an uninterrupted one.
    """
    for torch_optimizer in _torch_optimizers(optimizer):
        for group in torch_optimizer.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                state = torch_optimizer.state.get(param)
                if state and "step" in state:
                    state["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


@torch.no_grad()  # states are copied into parameters in place
def load(
    checkpoint: Checkpoint, model: list[Any], optimizer: Any, beside: Beside | None = None
) -> TrainState:
    """Restore model, optimizer, the models trained beside them and (when the layout is
    unchanged) RNG states."""
    beside = beside or {}
    optimizers = [optimizer, *(other_optimizer for _, other_optimizer in beside.values())]
    for each in optimizers:
        _materialize_optimizer_state(each)
    loaded = dist_checkpointing.load(
        sharded_state(model, optimizer, True, beside), str(checkpoint.path)
    )
    _load_models(model, loaded)
    optimizer.load_state_dict(loaded["optimizer"])
    for name, (other, other_optimizer) in beside.items():
        part = loaded[name]
        _load_models(other, {key: _strip(value, f"{name}.") for key, value in part.items()})
        other_optimizer.load_state_dict(part["optimizer"])
    for each in optimizers:
        _restore_adam_steps(each)
    rng_file = checkpoint.path / RNG_DIR / f"rank_{dist.get_rank():05d}.pt"
    if checkpoint.state.world == _world() and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return checkpoint.state


def clean_temporary(directory: Path) -> None:
    """Remove `.tmp-` folders a crashed save left (rank 0, before training starts)."""
    if directory.is_dir():
        for path in directory.iterdir():
            if path.name.startswith(TMP_PREFIX):
                shutil.rmtree(path, ignore_errors=True)


def apply_retention(directory: Path, save_top_k: int, monitor: str, mode: str) -> list[Path]:
    """Keep the newest checkpoint plus the `save_top_k` best by `monitor`; -1 keeps all."""
    checkpoints = complete_checkpoints(directory)
    if save_top_k < 0 or not checkpoints:
        return []
    newest = checkpoints[-1]
    sign = 1.0 if mode == "min" else -1.0

    def score(checkpoint: Checkpoint) -> float:
        value = checkpoint.state.metrics.get(monitor, math.nan)
        return math.inf if math.isnan(value) else sign * value

    best = sorted(checkpoints, key=lambda c: (score(c), -c.state.step))[:save_top_k]
    keep = {c.path for c in best} | {newest.path}
    removed = []
    for checkpoint in checkpoints:
        if checkpoint.path not in keep:
            # Drop the state file first: a crash mid-delete leaves a folder resume ignores.
            (checkpoint.path / STATE_FILE).unlink(missing_ok=True)
            shutil.rmtree(checkpoint.path, ignore_errors=True)
            removed.append(checkpoint.path)
    return removed
