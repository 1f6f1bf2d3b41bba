"""megatron-core's import, made lighter for the job programs.

- Without its kernel fuser on a machine with no GPU. `megatron.core.jit` sets `jit_fuser =
  torch.compile`, and a dozen modules decorate their fused kernels with it at import, so
  importing megatron-core imports TorchDynamo and Inductor: about 2 of the 5 seconds every CPU
  job spends starting. On CPU those kernels never run (the job turns bias-activation,
  bias-dropout and softmax fusion off without a GPU), so on a machine where
  `torch.cuda.is_available()` is false the fuser becomes megatron-core's own `noop_decorator`
  (what its `disable_jit_fuser()` sets) before any module uses it. With a GPU, nothing
  changes. LAUNCHER_KEEP_JIT_FUSER=1 keeps the fuser everywhere.
- Without Weights & Biases. Where wandb is installed, megatron-core's package import imports it
  (about a second) for its own inference and timer logging, which the jobs never use: they log
  to W&B through `jobs/training/wandb_logger`, which imports wandb itself when a recipe asks.
  While megatron-core's package runs, `wandb` is not importable to it (its `except ImportError`
  branches run); afterwards it is importable again as usual.
- Without boto3 (AWS's client, and urllib3 under it: a quarter to half a second). It is
  imported, if installed, by TensorBoard's file layer (megatron-core's timers import its writer)
  for `s3://` log folders, and by megatron-core's indexed datasets for `s3://` data; the jobs
  read their data from, and write their logs to, the file system only. While those modules
  run, boto3 is not importable to them; afterwards it is again. The same for fsspec (a
  quarter of a second), which TensorBoard's file layer imports for other remote folders.
- Without TensorBoard's writer (torch.utils.tensorboard and the TensorBoard protobufs under
  it: about 0.4 s), which megatron-core's timers import for their own logging. Only the
  training loop's metrics writer (`jobs/training/metrics.py`, on the rank that writes them)
  uses it; it imports it itself, so conversion, evaluation, serving and the other ranks never
  load it.

`launcher_scripts/jobs/__init__.py` installs this, so it is in place before a job program
imports megatron-core.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

PACKAGE = "megatron.core"
MODULE = "megatron.core.jit"
SWITCH = "LAUNCHER_KEEP_JIT_FUSER"
UNUSED = ("wandb", "boto3", "fsspec", "torch.utils.tensorboard")
# Modules importing boto3 for object storage the jobs do not use (megatron-core's package runs
# TensorBoard's file layer).
WITHOUT_BOTO3 = (
    "megatron.core.datasets.indexed_dataset",
    "megatron.core.datasets.object_storage_utils",
)


def no_gpu() -> bool:
    import torch  # megatron-core imported it before its jit module

    return not torch.cuda.is_available()


def _fuser_off_without_gpu(module: ModuleType) -> None:
    noop: Any = getattr(module, "noop_decorator", None)
    if noop is not None and os.environ.get(SWITCH) != "1" and no_gpu():
        module.jit_fuser = noop


class _LighterMegatron(importlib.abc.MetaPathFinder):
    """Finds megatron.core, megatron.core.jit and the dataset modules above as Python would,
    and runs them as above."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in (PACKAGE, MODULE, *WITHOUT_BOTO3):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            if fullname == MODULE:
                run_module(module)
                _fuser_off_without_gpu(module)
                return
            unused = UNUSED if fullname == PACKAGE else ("boto3",)
            blocked = [name for name in unused if name not in sys.modules]
            for name in blocked:
                sys.modules[name] = None  # type: ignore[assignment]  # import raises ImportError
            try:
                run_module(module)
            finally:
                for name in blocked:
                    if sys.modules.get(name, 0) is None:
                        del sys.modules[name]

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Once per process, before megatron-core is imported; nothing if it already is."""
    if PACKAGE in sys.modules:
        return
    if not any(isinstance(finder, _LighterMegatron) for finder in sys.meta_path):
        sys.meta_path.insert(0, _LighterMegatron())
