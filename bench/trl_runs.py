"""What the benchmarks against TRL's trainers share: the tiny model and its Hugging Face
export, and a TRL trainer's median step time."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from bench.serve import make_model
from bench.tuning import WARM_UP_STEPS


def tiny_model_and_export(work: Path) -> tuple[Path, Path]:
    """The tiny model's portable file (made, or the one a previous run left in `work`) and its
    Hugging Face export (GPT2LMHeadModel, by the conversion job's own export)."""
    model = work / "results" / "gpt3_tiny" / "convert_nemo" / "megatron_gpt.nemo"
    if not model.is_file():
        model = make_model(work)
    folder = work / "hf_tiny"
    if not (folder / "config.json").is_file():
        import launcher_scripts.families  # noqa: F401  (the families' tensor shapes)
        from launcher_scripts.jobs.conversion.convert import write_hf_from_portable

        write_hf_from_portable(model, folder)
    return model, folder


def median_step(make_trainer: Any) -> float:
    """Train the TRL trainer `make_trainer(callbacks)` builds; its median step time after the
    first WARM_UP_STEPS (a callback at each step's end)."""
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            self.ends.append(time.perf_counter())

    timer = StepTimes()
    trainer = make_trainer([timer])
    start = time.perf_counter()
    trainer.train()
    ends = [start, *timer.ends]
    steps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    return statistics.median(steps[WARM_UP_STEPS:])
