"""Training runs: the pretraining program started as a job starts it, and what its logs say."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.support import REPO
from tests.support.commands import ONE_THREAD

PRETRAIN = "launcher_scripts.jobs.training.pretrain"


def pretrain_command(config: Path, processes: int) -> list[str]:
    program = ["-m", PRETRAIN, "--config", str(config)]
    if processes == 1:
        return [sys.executable, *program]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    return [sys.executable, *launcher, *program]


def train(config: Path, processes: int = 1, timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(
        pretrain_command(config, processes),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        env=ONE_THREAD,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def losses(log_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["reduced_train_loss"] for r in records if "reduced_train_loss" in r}


def val_losses(log_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val_loss"] for r in records if "val_loss" in r}


def assert_same_losses(a: Path, b: Path, tolerance: float) -> None:
    first, second = losses(a), losses(b)
    assert sorted(first) == sorted(second)
    worst = max(abs(first[s] - second[s]) for s in first)
    assert worst <= tolerance, (first, second)
    assert val_losses(a).keys() == val_losses(b).keys()
    for step, value in val_losses(a).items():
        assert abs(value - val_losses(b)[step]) <= tolerance


def stop_with_signal(config: Path, log_dir: Path, processes: int) -> int:
    """Start training, send SIGTERM once a few steps are logged, return the exit code."""
    process = subprocess.Popen(
        pretrain_command(config, processes),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=ONE_THREAD,
    )
    # Generous: a busy machine trains slowly. Signalled earlier the test would be another one.
    metrics_file, deadline = log_dir / "metrics.jsonl", time.monotonic() + 1800
    try:
        while process.poll() is None:
            if metrics_file.exists() and len(losses(log_dir)) >= 3:
                break
            assert time.monotonic() < deadline, "training logged no 3 steps in 1800 s"
            time.sleep(0.05)
    finally:
        # The whole group, as Slurm or a shell's Ctrl-C would: torchrun and its workers.
        os.killpg(process.pid, signal.SIGTERM)
    return process.wait(timeout=600)


def write_training_config(prepared: Path, log_dir: Path, *overrides: str) -> Path:
    """The training stage's resolved recipe, as the launcher writes it for the job, reading the
    data under `prepared` and logging to `log_dir`."""
    from omegaconf import OmegaConf

    from launcher_scripts.config.compose import compose_config

    cfg = compose_config(
        [
            f"data_dir={prepared}/data",
            f"base_results_dir={prepared}/results",
            f"training.exp_manager.explicit_log_dir={log_dir}",
            *overrides,
        ]
    )
    path = log_dir.parent / f"{log_dir.name}.yaml"
    OmegaConf.save(OmegaConf.create(OmegaConf.to_container(cfg.training, resolve=True)), path)
    return path


def in_process_check(script: str, log_dir: Path, *args: str, stage: str = "peft") -> dict[str, Any]:
    """Run tests/scripts/<script>.py on the tuning run in `log_dir`; its JSON report."""
    config = next(log_dir.parent.glob("*_hydra.yaml"))
    result = subprocess.run(
        [sys.executable, "-m", f"tests.scripts.{script}", str(config), stage, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# Small and quick; a vocabulary padded to 8192 at TP 1 and TP 2 alike (8000 real tokens), so
# layouts compute the same logits.
SMALL_GPT = (
    "training.model.make_vocab_size_divisible_by=4096",
    "training.model.num_layers=2",
    "training.model.hidden_size=64",
    "training.model.ffn_hidden_size=256",
    "training.model.micro_batch_size=2",
    "training.model.global_batch_size=4",
    "training.model.optim.sched.warmup_steps=2",
    "training.trainer.log_every_n_steps=1",
    "training.trainer.val_check_interval=4",
    "training.trainer.limit_val_batches=1",
)


def write_small_gpt_config(prepared: Path, log_dir: Path, *overrides: str) -> Path:
    return write_training_config(prepared, log_dir, *SMALL_GPT, *overrides)
