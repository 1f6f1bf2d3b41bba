"""A tuning stage's trainer (the training loop with its TuningTask) built in this process (one
rank, CPU), for the in-process checks of tests/scripts/peft_frozen.py, lora_checks.py and
packed_losses.py."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf


@contextmanager
def built_tuner(config: str, stage: str) -> Iterator[Any]:
    from launcher_scripts.jobs.training import cpu_compat, runtime

    cpu_compat.patch_cuda_queries()
    cpu_compat.CudaDevicesOnCpu().__enter__()
    from launcher_scripts.formats import portable
    from launcher_scripts.jobs.fine_tuning.finetune import training_cfg
    from launcher_scripts.jobs.fine_tuning.tuner import TuningTask
    from launcher_scripts.jobs.training.pretrain import StopSignals
    from launcher_scripts.jobs.training.trainer import Trainer
    from launcher_scripts.ports import free_port
    from launcher_scripts.recipes.tuning import read_spec

    recipe = OmegaConf.load(config)
    with tempfile.TemporaryDirectory() as scratch:
        recipe.exp_manager.explicit_log_dir = str(Path(scratch) / "log")
        spec = read_spec(recipe, stage)
        base = portable.read(spec.base_model, Path(scratch))
        cfg = training_cfg(recipe, spec, base.config)
        os.environ["MASTER_PORT"] = str(free_port("127.0.0.1"))
        runtime.init_distributed(runtime.process_info(), False, 60)
        try:
            yield Trainer(cfg, False, StopSignals(), TuningTask(cfg, spec, base))
        finally:
            runtime.shutdown()
