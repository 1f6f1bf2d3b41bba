"""megatron-core's import without its kernel fuser on a machine with no GPU.

`megatron.core.jit` sets `jit_fuser = torch.compile`, and a dozen modules decorate their fused
kernels with it at import, so importing megatron-core imports TorchDynamo and Inductor: about
2 of the 5 seconds every CPU job spends starting. On CPU those kernels never run (the job turns
bias-activation, bias-dropout and softmax fusion off without a GPU), so on a machine where
`torch.cuda.is_available()` is false the fuser becomes megatron-core's own `noop_decorator`
(what its `disable_jit_fuser()` sets) before any module uses it. With a GPU, nothing changes.

`launcher_scripts/jobs/__init__.py` installs this, so it is in place before a job program
imports megatron-core. LAUNCHER_KEEP_JIT_FUSER=1 keeps the fuser everywhere.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

MODULE = "megatron.core.jit"
SWITCH = "LAUNCHER_KEEP_JIT_FUSER"


def no_gpu() -> bool:
    import torch  # megatron-core imported it before its jit module

    return not torch.cuda.is_available()


class _FuserOffWithoutGpu(importlib.abc.MetaPathFinder):
    """Finds megatron.core.jit as Python would, and sets its fuser to the no-op after it runs."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            noop: Any = getattr(module, "noop_decorator", None)
            if noop is not None and no_gpu():
                module.jit_fuser = noop

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Once per process, before megatron-core is imported; nothing if it already is."""
    if os.environ.get(SWITCH) == "1" or MODULE in sys.modules:
        return
    if not any(isinstance(finder, _FuserOffWithoutGpu) for finder in sys.meta_path):
        sys.meta_path.insert(0, _FuserOffWithoutGpu())
