"""The training loop's side of `model.nsys_profile`: open the capture before step start_step
and close it after step end_step, on the ranks nsys profiles (launcher_scripts.jobs.profiled).

nsys runs with --capture-range=cudaProfilerApi, so it records only between CUDA's
cudaProfilerStart and cudaProfilerStop: the steps asked for, not start-up or checkpointing.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from launcher_scripts.recipes.profiling import NsysProfile


class NsysCapture:
    def __init__(self, profile: NsysProfile | None, rank: int) -> None:
        self.profile = profile if profile is not None and profile.covers(rank) else None
        self.shapes: contextlib.AbstractContextManager[Any] | None = None
        self.open = False

    def before_step(self, step: int) -> None:
        """`step`: the step about to run, counted from 1."""
        profile = self.profile
        if profile is None or self.open or not profile.start_step <= step <= profile.end_step:
            return
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        if profile.gen_shape:
            self.shapes = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self.shapes.__enter__()
        self.open = True

    def after_step(self, step: int) -> None:
        if self.open and self.profile is not None and step >= self.profile.end_step:
            self.close()

    def close(self) -> None:
        if not self.open:
            return
        torch.cuda.synchronize()
        if self.shapes is not None:
            self.shapes.__exit__(None, None, None)
            self.shapes = None
        torch.cuda.profiler.stop()
        self.open = False
