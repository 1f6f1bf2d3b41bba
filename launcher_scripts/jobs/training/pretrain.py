"""Pretraining of every model family that trains, on megatron-core (the training stage's job).

`python -m launcher_scripts.jobs.training.pretrain --config F`: F is the training stage's
resolved recipe (`<results_dir>/<run.name>_hydra.yaml`), whose `model_family` picks the
family's torch side (its `runtime` module under jobs/models/). The process finds its rank
from torchrun or Slurm, so it runs under `torchrun` or straight under `srun`.

Exit codes: 0 finished (or stopped at trainer.max_time after a checkpoint); 75 stopped by
SIGTERM or SIGUSR1 after saving a checkpoint, so the job can be requeued and resume; 1 failed.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher_scripts.formats.progress import STOP_SIGNALS
from launcher_scripts.jobs.refusal import refuse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the training stage's resolved YAML")
    return parser.parse_args(argv)


class StopSignals:
    """SIGTERM/SIGUSR1 ask for a checkpoint and a clean exit at the end of the current step."""

    def __init__(self) -> None:
        self.received: int | None = None
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.received = signum


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = OmegaConf.load(args.config)
    assert isinstance(cfg, DictConfig)
    # Imported here so `--help` and config errors are instant.
    from launcher_scripts.jobs.training import runtime, wandb_logger

    on_gpu, info = runtime.start_job(cfg)
    from launcher_scripts.errors import ConfigError
    from launcher_scripts.families import family_of
    from launcher_scripts.formats.tokenizer import TokenizerError
    from launcher_scripts.jobs.training.runtime import JobError
    from launcher_scripts.jobs.training.trainer import PretrainingTask, Trainer
    from launcher_scripts.recipes.training import rendezvous_timeout

    try:
        wandb_logger.check_ready(cfg.exp_manager, "training")
        family = family_of(cfg, "training")
        if not family.runs("training"):
            raise JobError(
                f"training.model_family: {family.name} pretraining has no job program in this "
                "launcher version yet (the launcher's preflight refuses such runs)"
            )
        runtime.init_distributed(info, on_gpu, rendezvous_timeout(cfg))
        from launcher_scripts.jobs.training.restored import open_restored

        restored = open_restored(cfg)
        trainer = Trainer(cfg, on_gpu, StopSignals(), PretrainingTask(restored))
        return trainer.fit()
    except (JobError, TokenizerError, ConfigError) as error:
        # Problems with the inputs, not bugs: one line that says what to change.
        return refuse(error)
    finally:
        runtime.shutdown()


if __name__ == "__main__":
    sys.exit(main())
