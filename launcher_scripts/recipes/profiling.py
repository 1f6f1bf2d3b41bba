"""`model.nsys_profile`: an Nsight Systems capture of chosen steps on chosen ranks.

NeMo's recipes carry the section (enabled, trace, start_step, end_step, ranks, gen_shape);
here it means what it meant there. The training job's processes on the listed ranks start
under `nsys profile --capture-range=cudaProfilerApi`, and the training loop opens the capture
before step `start_step` and closes it after step `end_step` (steps counted from 1, as the
log counts them), so the report holds those steps only. `gen_shape` records each operator's
input shapes in its NVTX range (torch's emit_nvtx with record_shapes).

Pure Python: the stage checks the section, renders the wrapped command, and the job reads it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher_scripts.config.checks import require_each_choice, require_int
from launcher_scripts.errors import ConfigError

# The job program that starts a command under nsys on the profiled ranks.
PROFILED = "launcher_scripts.jobs.profiled"
REPORTS = "nsys_profile"  # the reports' folder, in the run's log folder

# nsys profile --trace values (Nsight Systems 2024-2025 on Linux x86_64 and aarch64).
TRACES = (
    "cuda",
    "nvtx",
    "cublas",
    "cublas-verbose",
    "cudnn",
    "cusparse",
    "cusparse-verbose",
    "cusolver",
    "cusolver-verbose",
    "osrt",
    "mpi",
    "ucx",
    "openmp",
    "openacc",
    "python-gil",
    "gds",
    "none",
)


@dataclass(frozen=True)
class NsysProfile:
    start_step: int
    end_step: int
    ranks: tuple[int, ...]
    trace: tuple[str, ...]
    gen_shape: bool

    def covers(self, rank: int) -> bool:
        return rank in self.ranks

    def wrapped(self, module: str, args: tuple[str, ...], log_dir: Path) -> tuple[str, ...]:
        """The arguments of PROFILED that run `module args` under nsys on the listed ranks."""
        return (
            f"--ranks={','.join(map(str, self.ranks))}",
            f"--trace={','.join(self.trace)}",
            f"--output={log_dir / REPORTS}",
            "--",
            module,
            *args,
        )


def read_nsys_profile(
    model: Mapping[str, Any], key_prefix: str, world_size: int, on_gpu: bool
) -> NsysProfile | None:
    """The checked section, or None when it is absent or not enabled."""
    section = model.get("nsys_profile")
    prefix = f"{key_prefix}.nsys_profile"
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ConfigError(prefix, "is not a section", "Give enabled, start_step, end_step, ...")
    enabled = section.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError(f"{prefix}.enabled", f"{enabled!r} is not true or false", "Fix it")
    if not enabled:
        return None
    if not on_gpu:
        raise ConfigError(
            f"{prefix}.enabled",
            "is true but the job runs on CPUs: the capture opens and closes with CUDA's "
            "profiler API, so it would record nothing",
            "Set it to false, or train on GPUs (trainer.accelerator=gpu)",
        )
    start = require_int(f"{prefix}.start_step", section.get("start_step"), 1)
    end = require_int(f"{prefix}.end_step", section.get("end_step"), 1)
    if end < start:
        raise ConfigError(
            f"{prefix}.end_step",
            f"{end} is before start_step {start}",
            f"Set it to {start} or later (both steps are profiled)",
        )
    ranks = section.get("ranks")
    if not isinstance(ranks, Sequence) or isinstance(ranks, str) or not ranks:
        raise ConfigError(f"{prefix}.ranks", f"{ranks!r} is not a list of ranks", "e.g. [0]")
    for index, rank in enumerate(ranks):
        if require_int(f"{prefix}.ranks[{index}]", rank, 0) >= world_size:
            raise ConfigError(
                f"{prefix}.ranks[{index}]",
                f"{rank} is not a rank of this run ({world_size} processes)",
                f"Use ranks from 0 to {world_size - 1}",
            )
    trace = section.get("trace") or ("cuda", "nvtx")
    if isinstance(trace, str):
        trace = [part for part in trace.split(",") if part]
    require_each_choice(f"{prefix}.trace", trace, TRACES, "an nsys trace")
    gen_shape = section.get("gen_shape", False)
    if not isinstance(gen_shape, bool):
        raise ConfigError(f"{prefix}.gen_shape", f"{gen_shape!r} is not true or false", "Fix it")
    if gen_shape and "nvtx" not in trace:
        raise ConfigError(
            f"{prefix}.gen_shape",
            "is true but trace has no nvtx: the shapes are written in NVTX ranges",
            f"Add nvtx to {prefix}.trace, or set gen_shape=false",
        )
    return NsysProfile(start, end, tuple(sorted(set(ranks))), tuple(trace), gen_shape)
