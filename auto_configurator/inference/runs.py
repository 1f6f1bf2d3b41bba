"""What the inference search measures and how: a `Point` per path, layout and batch size, and
the runner path (`bench.py` in TP x PP processes) with the process handling both paths
share.

Every measuring process runs on this machine, one at a time (a measurement must not share the
machine with another), in a session of its own so that a time limit stops all of it. On a
machine without GPUs each process gets one CPU thread (OMP_NUM_THREADS=1 unless it is set), so
that a process stands for a GPU and layouts compare as they would on GPUs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from auto_configurator.inference.settings import InferenceSettings
from launcher_scripts.clusters.base import python_argv
from launcher_scripts.jobs.export.serve import JOB_VARIABLES
from launcher_scripts.jobspec import Command

RUNNER = "runner"  # the generation runner in TP x PP processes (torchrun when more than one)
BENCH_MODULE = "auto_configurator.inference.bench"
SEED = 1234  # every request samples with this seed, so repeats generate the same tokens
ERROR_PATTERN = re.compile(r"error|exception|killed", re.IGNORECASE)


@dataclass(frozen=True)
class Point:
    """One path, layout and batch size, measured or why not."""

    path: str  # RUNNER or "triton"
    tensor: int
    pipeline: int
    batch: int
    latencies_s: tuple[float, ...] = ()
    generated_tokens: int | None = None  # per request (every repeat generates the same)
    rows_ended_early: int = 0  # rows that stopped (eod) before output_len
    status: str = "measured"  # measured | failed: ... | timeout: ... | skipped: ... | not run: ...
    log: str = ""

    @property
    def gpus(self) -> int:
        return self.tensor * self.pipeline

    @property
    def measured(self) -> bool:
        return self.status == "measured" and bool(self.latencies_s)

    @property
    def latency_s(self) -> float | None:
        return statistics.median(self.latencies_s) if self.measured else None

    @property
    def tokens_per_s(self) -> float | None:
        latency = self.latency_s
        if latency is None or self.generated_tokens is None:
            return None
        return self.generated_tokens / latency

    @property
    def tokens_per_s_per_gpu(self) -> float | None:
        throughput = self.tokens_per_s
        return None if throughput is None else throughput / self.gpus


def environment(root: Path, on_gpu: bool) -> dict[str, str]:
    """The measuring processes' environment: the checkout importable, no rank variables of a
    job this search may run in (each measurement forms its own group)."""
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES | {"HYDRA_FULL_ERROR"}}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    if not on_gpu:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def start(argv: Sequence[str], log: Path, cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        return subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            start_new_session=True,  # a time limit stops the whole process group
        )


def run_logged(
    argv: Sequence[str], log: Path, cwd: Path, env: dict[str, str], timeout_s: float
) -> int | None:
    """Run to its end, output in `log`; the exit code, or None when stopped at the limit."""
    process = start(argv, log, cwd, env)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop(process)
        return None
    except KeyboardInterrupt:
        stop(process)
        raise


def stop(process: subprocess.Popen, sig: signal.Signals = signal.SIGTERM) -> None:
    """Signal the process's group, then kill the group if it has not ended within a minute."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, sig)
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        process.wait()


def last_error_line(log: Path) -> str:
    """The last line that names an error, else the last line, of a log."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "no log"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if ERROR_PATTERN.search(line):
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def runner_command(
    settings: InferenceSettings, tensor: int, pipeline: int, prompts: Path, out: Path
) -> Command:
    args = (
        f"--model={settings.model_file}",
        f"--tensor={tensor}",
        f"--pipeline={pipeline}",
        f"--prompts={prompts}",
        f"--batch-sizes={','.join(str(b) for b in settings.batch_sizes)}",
        f"--output-len={settings.output_len}",
        f"--top-k={settings.topk}",
        f"--top-p={settings.topp}",
        f"--beam-width={settings.beam_width}",
        f"--seed={SEED}",
        f"--repeats={settings.repeats}",
        f"--out={out}",
    )
    return Command(BENCH_MODULE, args, nproc_per_node=tensor * pipeline)


def measure_runner(
    settings: InferenceSettings,
    tensor: int,
    pipeline: int,
    prompts: Path,
    root: Path,
    env: dict[str, str],
) -> list[Point]:
    """Every batch size at one layout, in one launch of TP x PP processes."""
    folder = settings.folder / "runs" / f"{RUNNER}_tp{tensor}_pp{pipeline}"
    out, log = folder / "results.json", folder / "log.txt"
    out.unlink(missing_ok=True)  # a result of an earlier search must not count
    argv = python_argv(runner_command(settings, tensor, pipeline, prompts, out), sys.executable)
    code = run_logged(argv, log, root, env, settings.time_limit_s)
    measured = _read_results(out)
    points = []
    for batch in settings.batch_sizes:
        entry = measured.get(batch)
        if entry and entry.get("latencies_s") and not entry.get("failure"):
            tokens = entry["generated_tokens"]
            points.append(
                Point(
                    RUNNER,
                    tensor,
                    pipeline,
                    batch,
                    latencies_s=tuple(entry["latencies_s"]),
                    generated_tokens=int(statistics.median(tokens)),
                    rows_ended_early=int(entry.get("rows_ended_early", 0)),
                    log=str(log),
                )
            )
            continue
        if entry and entry.get("failure"):
            status = f"failed: {entry['failure']}"
        elif code is None:
            status = f"timeout: run.time_limit ({settings.time_limit_s} s) reached"
        elif code == 0:
            status = "failed: the run wrote no result for this batch size"
        else:
            status = f"failed: exit code {code}: {last_error_line(log)}"
        points.append(Point(RUNNER, tensor, pipeline, batch, status=status, log=str(log)))
    return points


def _read_results(path: Path) -> dict[int, dict]:
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {int(entry["batch"]): entry for entry in report.get("batches", [])}
