"""The measured runs: short training runs of candidate layouts through the launcher itself.

Each run is `python3 main.py stages=[training] training=<base config> <layout overrides>` with
the run shortened to max_steps_per_run steps or max_minutes_per_run minutes, its results under
`<logs>/candidate_<i>`. On cluster_type=local the launcher runs each job to its end, one after
the other; on a cluster (bcm) every run is submitted first and then followed with
`python3 -m launcher_scripts status <run dir> --json` until all have ended. The measured step
time is the median `train_step_timing` of the logged steps after the warm-up steps.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from auto_configurator.base_config import max_time, time_limit
from auto_configurator.candidates import Candidate
from auto_configurator.recipes import STAGE, launcher_overrides
from auto_configurator.settings import TrainSettings
from launcher_scripts.errors import ConfigError

TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "LOST"})
OOM_PATTERN = re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)
ERROR_PATTERN = re.compile(r"error", re.IGNORECASE)
SLACK_S = 600  # a run's job time limit, and the local wait, beyond max_minutes_per_run
LAUNCH_LOG = "autoconfig_launch.out"


@dataclass(frozen=True)
class Measurement:
    state: str  # the job's final state, or REFUSED when the launcher did not start it
    exit_code: int | None
    step_time_s: float | None = None
    steps: int = 0  # logged steps the step time is the median of
    tflops_per_gpu: float | None = None
    peak_memory_gb: float | None = None
    failure: str | None = None  # why there is no step time: out of memory, an error line...
    log: str | None = None

    @property
    def measured(self) -> bool:
        return self.step_time_s is not None and self.failure is None


@dataclass(frozen=True)
class Run:
    index: int  # candidate_<index>: its rank by predicted step time
    candidate: Candidate
    run_dir: Path
    argv: tuple[str, ...]
    warmup_steps: int  # logged steps left out of the measured step time


def launcher_main(cfg: DictConfig) -> Path:
    path = Path(str(cfg.launcher_scripts_path)) / "main.py"
    if not path.is_file():
        raise ConfigError(
            "launcher_scripts_path",
            f"{path} does not exist",
            "Point launcher_scripts_path at the launcher checkout (the folder with main.py)",
        )
    return path


def plan_runs(
    cfg: DictConfig,
    settings: TrainSettings,
    base_path: Path,
    base_recipe: DictConfig,
    candidates: Sequence[Candidate],
) -> list[Run]:
    """The launcher command of each measured run, candidate_1 the predicted fastest."""
    main = launcher_main(cfg)
    steps = settings.max_steps_per_run
    minutes = settings.max_minutes_per_run
    shortened = [
        f"{STAGE}.trainer.max_steps={steps}",
        f"{STAGE}.trainer.max_time={max_time(minutes * 60)}",
        f"{STAGE}.run.time_limit={time_limit((minutes * 60 + SLACK_S) / 86400)}",
        f"{STAGE}.trainer.log_every_n_steps=1",  # every step's time is logged
        f"{STAGE}.trainer.val_check_interval={steps + 1}",  # no validation
        f"{STAGE}.exp_manager.resume_if_exists=false",
        f"{STAGE}.exp_manager.checkpoint_callback_params.every_n_train_steps={steps}",
    ]
    sched = base_recipe.model.optim.sched
    if "warmup_steps" in sched:
        shortened.append(f"{STAGE}.model.optim.sched.warmup_steps=1")
    if "constant_steps" in sched:
        shortened.append(f"{STAGE}.model.optim.sched.constant_steps=0")
    common = [
        "stages=[training]",
        f"{STAGE}={base_path}",
        *launcher_overrides(cfg),
        f"base_results_dir={settings.logs}",
        *shortened,
    ]
    if cfg.training_container:
        common.append(f"container={cfg.training_container}")
    mounts = [str(m) for m in cfg.container_mounts or () if m]
    if mounts:
        common.append(f"container_mounts=[{','.join(mounts)}]")
    runs = []
    for index, candidate in enumerate(candidates, start=1):
        run_dir = settings.logs / f"candidate_{index}"
        name = f"{base_recipe.run.name}_candidate_{index}"
        argv = [
            sys.executable,
            str(main),
            *common,
            f"{STAGE}.run.name={name}",
            f"{STAGE}.run.results_dir={run_dir}",
            *candidate.overrides(STAGE),
            *_wandb_overrides(cfg, name),
            *(str(o) for o in cfg.launcher_overrides or ()),
        ]
        runs.append(Run(index, candidate, run_dir, tuple(argv), settings.warmup_steps_per_run))
    return runs


def _wandb_overrides(cfg: DictConfig, name: str) -> list[str]:
    wandb = cfg.get("wandb") or {}
    if not wandb.get("enable"):
        return []
    overrides = [
        f"{STAGE}.exp_manager.create_wandb_logger=true",
        f"{STAGE}.exp_manager.wandb_logger_kwargs.project={wandb.project}",
        f"{STAGE}.exp_manager.wandb_logger_kwargs.name={name}",
    ]
    if wandb.get("api_key_file"):
        overrides.append(f"wandb_api_key_file={wandb.api_key_file}")
    return overrides


# ----- launching and following -------------------------------------------------------------


def _environment(cfg: DictConfig) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    root = str(cfg.launcher_scripts_path)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def launch(run: Run, cfg: DictConfig, timeout_s: float | None) -> int | None:
    """Start the launcher for one run, its output in <run dir>/autoconfig_launch.out; the
    launcher's exit code (None when it was stopped at `timeout_s`)."""
    run.run_dir.mkdir(parents=True, exist_ok=True)
    _forget_earlier_metrics(run.run_dir)
    with open(run.run_dir / LAUNCH_LOG, "wb") as out:
        process = subprocess.Popen(
            run.argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=str(cfg.launcher_scripts_path),
            env=_environment(cfg),
            start_new_session=True,  # so a timeout stops the run's whole process group
        )
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(process, signal.SIGTERM)
            return None
        except KeyboardInterrupt:
            # The run is in its own session: Ctrl-C reaches only this process, so pass it on
            # (the launcher then cancels its job) before stopping.
            _stop(process, signal.SIGINT)
            raise


def _stop(process: subprocess.Popen, sig: signal.Signals) -> None:
    os.killpg(process.pid, sig)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _forget_earlier_metrics(run_dir: Path) -> None:
    """A run folder reused from an earlier search must not lend its metrics to this one."""
    for stale in run_dir.glob("*/metrics.jsonl"):
        stale.unlink()


def job_status(run: Run, cfg: DictConfig) -> dict | None:
    """The run's training job record from `python3 -m launcher_scripts status --json`, or
    None when the launcher wrote no manifest (it refused the run)."""
    result = subprocess.run(
        [sys.executable, "-m", "launcher_scripts", "status", str(run.run_dir), "--json"],
        capture_output=True,
        text=True,
        cwd=str(cfg.launcher_scripts_path),
        env=_environment(cfg),
        timeout=300,
    )
    if result.returncode != 0:
        return None
    data = json.loads(result.stdout)
    jobs = [job for stage in data["stages"] if stage["stage"] == STAGE for job in stage["jobs"]]
    return jobs[0] if jobs else None


def run_local(
    runs: Sequence[Run],
    cfg: DictConfig,
    settings: TrainSettings,
    progress: Callable[[Run, Measurement], None],
) -> dict[int, Measurement]:
    """Each run to its end, one after the other."""
    results = {}
    timeout = settings.max_minutes_per_run * 60 + SLACK_S
    for run in runs:
        code = launch(run, cfg, timeout)
        record = job_status(run, cfg)
        if code is None:
            measurement = Measurement("TIMEOUT", None, failure=f"still running after {timeout:g} s")
        else:
            measurement = measure(run, record, code)
        results[run.index] = measurement
        progress(run, measurement)
    return results


def run_cluster(
    runs: Sequence[Run],
    cfg: DictConfig,
    progress: Callable[[Run, Measurement], None],
    poll_seconds: float,
) -> dict[int, Measurement]:
    """Submit every run, then poll their states until each has ended."""
    results: dict[int, Measurement] = {}
    pending = []
    for run in runs:
        code = launch(run, cfg, timeout_s=SLACK_S)
        if code != 0:
            results[run.index] = measure(run, job_status(run, cfg), code)
            progress(run, results[run.index])
        else:
            pending.append(run)
    while pending:
        time.sleep(poll_seconds)
        for run in list(pending):
            record = job_status(run, cfg)
            if record is None or record["state"] in TERMINAL_STATES:
                results[run.index] = measure(run, record, 0)
                progress(run, results[run.index])
                pending.remove(run)
    return results


# ----- reading a run -----------------------------------------------------------------------


def measure(run: Run, record: dict | None, launcher_code: int | None) -> Measurement:
    """What one run measured, or why it measured nothing."""
    launch_log = run.run_dir / LAUNCH_LOG
    if record is None:
        line = _last_error_line(launch_log) or f"exit code {launcher_code}"
        return Measurement(
            "REFUSED", launcher_code, failure=f"refused: {line}", log=str(launch_log)
        )
    state, code, log = record["state"], record.get("exit_code"), record.get("log")
    logs = [Path(log)] if log else []
    if log:
        logs += sorted(p for p in Path(log).parent.glob(Path(log).stem + "*") if p not in logs)
    text = "\n".join(_read(p) for p in [*logs, launch_log])
    records = _metrics(run.run_dir)
    if state != "COMPLETED":
        failure = _failure(state, code, text)
        return Measurement(state, code, failure=failure, log=log, **_timing(records, 0))
    timing = _timing(records, run.warmup_steps)
    if timing["step_time_s"] is None:
        return Measurement(state, code, failure="no training step was logged", log=log)
    return Measurement(state, code, log=log, **timing)


def _failure(state: str, code: int | None, text: str) -> str:
    if OOM_PATTERN.search(text):
        return "out of memory"
    if code == 137:
        return "killed (exit code 137: SIGKILL, e.g. the host's out-of-memory killer)"
    line = _last_error_line_of(text)
    detail = f": {line}" if line else ""
    return f"{state.lower()} with exit code {code}{detail}"


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _last_error_line(path: Path) -> str | None:
    return _last_error_line_of(_read(path))


def _last_error_line_of(text: str) -> str | None:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if ERROR_PATTERN.search(line):
            return line[:300]
    return lines[-1][:300] if lines else None


def _metrics(run_dir: Path) -> list[dict]:
    """The run's logged training steps, from the metrics.jsonl of its explicit_log_dir."""
    configs = sorted(run_dir.glob("*_hydra.yaml"))
    if not configs:
        return []
    config = OmegaConf.load(configs[0])
    log_dir = Path(str(config.exp_manager.explicit_log_dir))
    path = log_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if "train_step_timing" in r]


def _timing(records: list[dict], warmup: int) -> dict:
    """Median step time and TFLOP/s of the steps after `warmup`; all steps when no step is
    left after it (a run stopped early by max_minutes_per_run)."""
    kept = [r for r in records if r["step"] > warmup] or records
    if not kept:
        return {"step_time_s": None, "steps": 0}
    return {
        "step_time_s": statistics.median(r["train_step_timing"] for r in kept),
        "steps": len(kept),
        "tflops_per_gpu": statistics.median(r.get("model_tflops_per_gpu", 0.0) for r in kept),
        "peak_memory_gb": max(r.get("peak_memory_gb", 0.0) for r in kept),
    }
