"""The measured runs: short training runs of candidate layouts through the launcher itself.

Each run is `python3 main.py stages=[training] training=<base config> <layout overrides>` with
the run shortened to max_steps_per_run steps or max_minutes_per_run minutes, its results under
`<logs>/training_logs/candidate_<i>` (its resolved recipe in `<logs>/candidate_configs/`, the
folders NeMo's AutoConfigurator names). On cluster_type=local and bcp the launcher runs each job
to its end, one after the other (on BCP through bcprun on the BCP job's nodes); on Slurm (bcm)
every run is submitted first and then followed with `python3 -m launcher_scripts status <run
dir> --json` until all have ended (a status call that fails is retried at the next poll; Ctrl-C
cancels the runs still queued or running). The measured step time is the median
`train_step_timing` of the logged steps after the warm-up steps; failures are read from the exit
status and from every log file the job's backend names (on Slurm: each attempt's log and
sbatch's own output file).
"""

from __future__ import annotations

import contextlib
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
from launcher_scripts.clusters import BACKENDS, JobRecord
from launcher_scripts.clusters.base import TERMINAL_STATES
from launcher_scripts.errors import ConfigError
from launcher_scripts.manifest import STAGE_LINK

# torch's "CUDA out of memory", OutOfMemoryError, and Slurm's cgroup killer ("Detected 1
# oom_kill event ... killed by the cgroup out-of-memory handler").
OOM_PATTERN = re.compile(r"out[ -]of[ -]memory|OutOfMemoryError|oom[-_]kill", re.IGNORECASE)
ERROR_PATTERN = re.compile(r"error", re.IGNORECASE)
SLACK_S = 600  # a run's job time limit, and the local wait, beyond max_minutes_per_run
LAUNCH_LOG = "autoconfig_launch.out"
# In <logs>, as the NeMo launcher's AutoConfigurator names them: each measured run's folder, and
# the training recipe each ran (resolved).
TRAINING_LOGS = "training_logs"
CANDIDATE_CONFIGS = "candidate_configs"
# Polls in a row at which `status` may fail (a scheduler too busy to answer squeue, say)
# before a cluster run is given up as unknown.
STATUS_FAILURES_ALLOWED = 10


class StatusUnavailable(Exception):
    """`python3 -m launcher_scripts status` failed for a run that has a manifest."""


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
        run_dir = settings.logs / TRAINING_LOGS / f"candidate_{index}"
        name = f"{base_recipe.run.name}_candidate_{index}"
        argv = [
            sys.executable,
            str(main),
            *common,
            f"{STAGE}.run.name={name}",
            f"{STAGE}.run.results_dir={run_dir}",
            *candidate.overrides(STAGE, base_recipe.model),
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
    _forget_earlier_run(run.run_dir)
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
    _signal_group(process, sig)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        _signal_group(process, signal.SIGKILL)
        process.wait()


def _signal_group(process: subprocess.Popen, sig: signal.Signals) -> None:
    # The launcher may have just ended (a submission returns in seconds): nothing to stop.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)


def _forget_earlier_run(run_dir: Path) -> None:
    """A run folder reused from an earlier search must not lend its metrics, nor its link to
    the earlier run's manifest, to this one: a run the launcher refuses writes no manifest,
    and must not be read as the earlier run."""
    for stale in run_dir.glob("*/metrics.jsonl"):
        stale.unlink()
    (run_dir / STAGE_LINK).unlink(missing_ok=True)


def job_status(run: Run, cfg: DictConfig) -> dict | None:
    """The run's training job record from `python3 -m launcher_scripts status --json`, or
    None when the launcher wrote no manifest (it refused the run). StatusUnavailable when the
    run has a manifest but the status command failed (it asks the scheduler, which may not
    answer in time)."""
    if not (run.run_dir / STAGE_LINK).exists():
        return None
    try:
        result = subprocess.run(
            [sys.executable, "-m", "launcher_scripts", "status", str(run.run_dir), "--json"],
            capture_output=True,
            text=True,
            cwd=str(cfg.launcher_scripts_path),
            env=_environment(cfg),
            timeout=300,
        )
    except subprocess.TimeoutExpired:
        raise StatusUnavailable("status did not answer in 300 s") from None
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines() or [f"exit code {result.returncode}"]
        raise StatusUnavailable(lines[-1][:300])
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
        if code is None:
            measurement = Measurement("TIMEOUT", None, failure=f"still running after {timeout:g} s")
        else:
            try:
                measurement = measure(run, job_status(run, cfg), code)
            except StatusUnavailable as error:
                measurement = Measurement("UNKNOWN", code, failure=f"status failed: {error}")
        results[run.index] = measurement
        progress(run, measurement)
    return results


def run_cluster(
    runs: Sequence[Run],
    cfg: DictConfig,
    progress: Callable[[Run, Measurement], None],
    poll_seconds: float,
) -> dict[int, Measurement]:
    """Submit every run, then poll their states until each has ended. Ctrl-C cancels the
    submitted runs that have not ended (nobody would read them) before it stops the search."""
    results: dict[int, Measurement] = {}
    started: list[Run] = []  # a run interrupted during its submission may have been queued
    try:
        for run in runs:
            started.append(run)
            code = launch(run, cfg, timeout_s=SLACK_S)
            if code == 0:
                continue  # submitted: the polls follow it
            try:
                record = job_status(run, cfg)
            except StatusUnavailable:
                record = None  # the launcher's own error line says why
            results[run.index] = measure(run, record, code)
            progress(run, results[run.index])
        _follow([r for r in runs if r.index not in results], cfg, progress, poll_seconds, results)
    except KeyboardInterrupt:
        cancel_runs([r for r in started if r.index not in results], cfg)
        raise
    return results


def _follow(
    pending: list[Run],
    cfg: DictConfig,
    progress: Callable[[Run, Measurement], None],
    poll_seconds: float,
    results: dict[int, Measurement],
) -> None:
    """Poll the submitted runs until each has ended, its measurement then in `results`."""
    failures = {run.index: 0 for run in pending}
    while pending:
        time.sleep(poll_seconds)
        for run in list(pending):
            try:
                record = job_status(run, cfg)
            except StatusUnavailable as error:
                failures[run.index] += 1
                if failures[run.index] < STATUS_FAILURES_ALLOWED:
                    continue
                reason = f"status failed at {STATUS_FAILURES_ALLOWED} polls in a row: {error}"
                results[run.index] = Measurement("UNKNOWN", None, failure=reason)
            else:
                failures[run.index] = 0
                if record is not None and record["state"] not in TERMINAL_STATES:
                    continue
                results[run.index] = measure(run, record, 0)
            progress(run, results[run.index])
            pending.remove(run)


def cancel_runs(runs: Sequence[Run], cfg: DictConfig) -> None:
    """`python3 -m launcher_scripts cancel --now` for each run (its queued or running jobs):
    a trial run's checkpoint is worth no wait."""
    for run in runs:
        subprocess.run(
            [sys.executable, "-m", "launcher_scripts", "cancel", "--now", str(run.run_dir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=str(cfg.launcher_scripts_path),
            env=_environment(cfg),
            timeout=60,
        )
    if runs:
        print(f"interrupted: cancelled the {len(runs)} submitted runs", file=sys.stderr)


# ----- reading a run -----------------------------------------------------------------------


def measure(run: Run, record: dict | None, launcher_code: int | None) -> Measurement:
    """What one run measured, or why it measured nothing."""
    launch_log = run.run_dir / LAUNCH_LOG
    # No manifest, or one whose job never got an id (sbatch refused it): nothing ran.
    if record is None or record.get("job_ids") == []:
        line = _last_error_line(launch_log) or f"exit code {launcher_code}"
        return Measurement(
            "REFUSED", launcher_code, failure=f"refused: {line}", log=str(launch_log)
        )
    state, code, log = record["state"], record.get("exit_code"), record.get("log")
    job_text = "\n".join(_read(p) for p in _job_logs(record))
    records = _metrics(run.run_dir)
    if state != "COMPLETED":
        # The launcher's output holds the job's only when it ran the job (local); after a
        # submission it says no more than where the job went.
        launch_text = _read(launch_log) if launcher_code else ""
        failure = _failure(state, code, job_text, launch_text)
        return Measurement(state, code, failure=failure, log=log, **_timing(records, 0))
    timing = _timing(records, run.warmup_steps)
    if timing["step_time_s"] is None:
        return Measurement(state, code, failure="no training step was logged", log=log)
    return Measurement(state, code, log=log, **timing)


def _job_logs(record: dict) -> list[Path]:
    """The log the record names, files named after it, and every log file the job's backend
    knows (on Slurm: each attempt's log and sbatch's --output file, which holds slurmstepd's
    messages: a time limit, the cgroup out-of-memory killer)."""
    log = record.get("log")
    logs = [Path(log)] if log else []
    if log:
        logs += sorted(p for p in Path(log).parent.glob(Path(log).stem + "*") if p not in logs)
    backend = BACKENDS.get(record.get("backend", ""))
    if backend is not None and "job_ids" in record and "name" in record:
        job = JobRecord.from_json(record)
        logs += [found.path for found in backend().logs(job) if found.path not in logs]
    return logs


def _failure(state: str, code: int | None, job_text: str, launch_text: str) -> str:
    """Why a job that ended other than COMPLETED measured nothing: out of memory when any log
    says so, else the job logs' last error line, else the launcher's."""
    if OOM_PATTERN.search(job_text) or OOM_PATTERN.search(launch_text):
        return "out of memory"
    if code == 137:
        return "killed (exit code 137: SIGKILL, e.g. the host's out-of-memory killer)"
    line = _last_error_line_of(job_text) or _last_error_line_of(launch_text)
    detail = f": {line}" if line else ""
    # The Slurm backend's record has the scheduler's state but no exit code.
    status = state.lower() if code is None else f"{state.lower()} with exit code {code}"
    return f"{status}{detail}"


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
