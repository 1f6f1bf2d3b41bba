"""Training metrics: model FLOPs, `metrics.jsonl`, TensorBoard, W&B (`wandb_logger` opens the
run), progress lines, loss curve."""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch


def peak_memory_gb(on_gpu: bool) -> float:
    if on_gpu:
        return torch.cuda.max_memory_allocated() / 2**30
    # ru_maxrss is in KiB on Linux: the process's peak resident memory.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class MetricsLog:
    """Rank 0's record of a run: appends to `metrics.jsonl`, TensorBoard and optionally W&B."""

    def __init__(self, log_dir: Path, wandb_run: Any = None) -> None:
        self.path = log_dir / "metrics.jsonl"
        self.tensorboard = None
        self.wandb_run = wandb_run
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print("note: tensorboard is not installed; metrics go to metrics.jsonl only")
        else:
            self.tensorboard = SummaryWriter(log_dir=str(log_dir / "tensorboard"))

    def truncate_after(self, step: int) -> None:
        """On resume, drop records of steps the checkpoint does not contain (they are redone)."""
        if not self.path.exists():
            return
        kept = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step
        ]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        os.replace(tmp, self.path)

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record, sort_keys=True) + "\n")
        step = record["step"]
        for name, value in record.items():
            numeric = isinstance(value, int | float) and name not in ("step", "wall_time")
            if numeric and self.tensorboard is not None:
                self.tensorboard.add_scalar(name, value, step)
        if self.wandb_run is not None:
            values = {k: v for k, v in record.items() if k not in ("step", "wall_time")}
            self.wandb_run.log(values, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def progress_line(step: int, max_steps: int, record: dict[str, Any]) -> str:
    """One log line with a text progress bar; readable in a log file, unlike a redrawn bar."""
    width = 20
    done = int(width * step / max_steps)
    bar = "=" * done + (">" if done < width else "") + " " * (width - done - 1)
    parts = [f"[{bar}] {step}/{max_steps}"]
    for name, fmt in (
        ("reduced_train_loss", "loss {:.4f}"),
        ("lr", "lr {:.3e}"),
        ("grad_norm", "grad_norm {:.3f}"),
        ("moe_load_balancing_loss", "aux {:.3f}"),
        ("moe_load_max", "expert load max {:.2f}x"),
        ("train_step_timing", "{:.3f} s/step"),
        ("tokens_per_sec", "{:.0f} tok/s"),
        ("model_tflops_per_gpu", "{:.2f} TFLOP/s/GPU"),
        ("peak_memory_gb", "peak {:.2f} GiB"),
    ):
        if name in record:
            parts.append(fmt.format(record[name]))
    return " | ".join(parts)


def plot_loss_curve(metrics_file: Path, output: Path, title: str) -> bool:
    """loss_curve.png from the whole metrics.jsonl (resumed runs included); False if no data."""
    records = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    train = [(r["step"], r["reduced_train_loss"]) for r in records if "reduced_train_loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if not train:
        return False
    # A Figure of its own draws to the file without pyplot (a third of the import time).
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4))
    axes = figure.subplots()
    axes.plot(*zip(*train, strict=True), label="train loss")
    if val:
        axes.plot(*zip(*val, strict=True), "o-", label="validation loss")
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_title(f"{title}: first {train[0][1]:.3f}, last {train[-1][1]:.3f}")
    axes.grid(alpha=0.3)
    axes.legend()
    save_figure(figure, output)
    return True


def save_figure(figure: Any, output: Path) -> None:
    """A matplotlib Figure written to `output` whole: to a scratch file, then renamed."""
    figure.tight_layout()
    scratch = output.with_name(f".{output.name}.tmp.png")
    figure.savefig(scratch, dpi=100)
    os.replace(scratch, output)


def flush_stdout() -> None:
    sys.stdout.flush()
