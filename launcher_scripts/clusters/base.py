"""The backend interface: render a JobSpec to a script, submit it, ask about it, cancel it."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from launcher_scripts.errors import ConfigError
from launcher_scripts.jobspec import Command, JobSpec

TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "LOST"})


def nodes_key(job: JobSpec) -> str:
    """The key that sets a job's node count: only the stages with a trainer ask for more than
    one node."""
    return f"{job.stage}.trainer.num_nodes"


def check_gpus_per_node(jobs: Iterable[JobSpec], limit: int | None, setting: str) -> None:
    """A job asking for more GPUs per node than the cluster's nodes have would never start
    (Slurm pends it, a pod stays unschedulable): refused before anything is submitted.
    `limit`: the GPUs of one node (None: not known); `setting`: the key that says so."""
    if limit is None:
        return
    for job in jobs:
        asked = job.resources.gpus_per_node
        if asked > limit:
            raise ConfigError(
                job.resources.gpus_key or f"{job.stage}.trainer.devices",
                f"job {job.name} needs {asked} GPUs on each node but {setting} is {limit}",
                f"Use at most {limit} GPUs per node (a larger layout spans more nodes where "
                f"the stage allows it), or set {setting} to the GPUs the nodes have",
            )


def utc_now() -> str:
    """A timestamp for the manifest: ISO 8601 in UTC, to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class JobRecord:
    """What the run manifest keeps about one submitted job."""

    name: str
    stage: str
    backend: str
    script: str
    log: str
    state: str = "PENDING"
    job_ids: list[str] = field(default_factory=list)
    exit_code: int | None = None
    start: str | None = None
    end: str | None = None
    pid: int | None = None  # the local backend's process group
    # A job that checkpoints and exits with this code on its checkpoint signal (training):
    # cancel signals it and waits up to grace_seconds before ending it.
    checkpoint_exit_code: int | None = None
    grace_seconds: int | None = None
    # Nodes a requeue of a multi-node job left out: node -> {"attempt": N, "srun": its line}.
    excluded_nodes: dict[str, dict] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> JobRecord:
        return cls(**data)


class Backend(Protocol):
    name: str
    # True when submit() returns only after the job ended, so the pipeline can stop at a failure.
    synchronous: bool
    # The end of a rendered file's name, after the job's name (k8s writes "_manifest.yaml").
    script_suffix: str

    def render(self, job: JobSpec) -> str:
        """The script text. Deterministic: the same JobSpec gives the same bytes."""

    def plan_notes(self) -> list[str]:
        """What a run says about this cluster before its jobs (a dry run, beyond the
        scripts)."""

    def outer_launch(
        self, jobs: Sequence[JobSpec], overrides: Sequence[str]
    ) -> tuple[str, str] | None:
        """For a backend that runs inside a job started from outside: the script that starts
        that job, as (file name, text), which a dry run writes; None for the others."""

    def log_path(self, job: JobSpec, run_id: str) -> str: ...

    def jobs_use_launcher_environment(self) -> bool:
        """Whether jobs import their packages from the launcher's own Python environment (no
        container image), so that preflight can check those packages here."""

    def check_jobs(self, jobs: Sequence[JobSpec]) -> None:
        """Raise ConfigError when this cluster cannot run these jobs as they ask (more nodes
        than it has, say). Dry runs ask too: a scheduler that does not answer here (no Slurm
        on this machine) is not asked."""

    def check_submission(self, jobs: Sequence[JobSpec]) -> None:
        """Raise ConfigError when these jobs could not be submitted or run here (no scheduler,
        say, or more CPUs than any node has). Real runs only, after check_jobs."""

    def jobs_find_gpus(self) -> bool | None:
        """Whether the jobs' processes will find a CUDA GPU (a recipe asking for GPUs falls back
        to the CPU without one): known where they run on this machine, else None."""

    def submit(
        self,
        script: str,
        job: JobSpec,
        record: JobRecord,
        after: Sequence[str],
        on_start: Callable[[JobRecord], None],
    ) -> None:
        """Start the job (after the job ids in `after`) and fill in `record`.

        `on_start` is called once the job has ids, so its record is saved before it ends.
        """

    def refresh(self, record: JobRecord) -> None:
        """Update `record.state` from the scheduler, where there is one."""

    def cancel(self, record: JobRecord) -> int | None:
        """Ask the job to stop. A job that checkpoints gets its checkpoint signal and the
        seconds returned to save and exit (the caller waits with `stopped`, then calls
        `end`); None: nothing to wait for (ended now, or the scheduler enforces the grace)."""

    def stopped(self, record: JobRecord) -> bool:
        """Whether the job's program has ended (after `cancel`)."""

    def end(self, record: JobRecord) -> None:
        """End what is left of the job now: its leftover processes, or the job itself once
        its grace has passed."""

    def logs(self, record: JobRecord) -> list[JobLog]:
        """The job's log files that exist, in order (array tasks, then attempts)."""


class BackendDefaults:
    """What most backends answer to Backend's questions that not every backend needs: every
    backend derives from it and overrides what it has."""

    script_suffix = "_submission.sh"

    def plan_notes(self) -> list[str]:
        return []

    def outer_launch(
        self, jobs: Sequence[JobSpec], overrides: Sequence[str]
    ) -> tuple[str, str] | None:
        return None

    def check_jobs(self, jobs: Sequence[JobSpec]) -> None:
        return None  # nothing known here about the cluster's size

    def jobs_find_gpus(self) -> bool | None:
        return None  # the jobs run elsewhere


@dataclass(frozen=True)
class JobLog:
    path: Path
    task: int | None = None  # the array task that wrote it
    attempt: int | None = None  # 0 for the first run of a job, 1 after its first requeue

    @property
    def label(self) -> str:
        parts = [f"task {self.task}"] if self.task is not None else []
        parts += [f"attempt {self.attempt}"] if self.attempt is not None else []
        return ", ".join(parts)


DEFAULT_SIGNAL_GRACE = 120


def signal_grace_seconds(cluster: Any) -> int:
    """`cluster.signal_grace_seconds`: how long a checkpointing job (training) has to save and
    exit after its checkpoint signal, before it is ended. The same key on every backend."""
    grace = (cluster or {}).get("signal_grace_seconds", DEFAULT_SIGNAL_GRACE)
    if isinstance(grace, bool) or not isinstance(grace, int) or grace < 1:
        raise ConfigError(
            "cluster.signal_grace_seconds",
            f"{grace!r} is not a positive integer",
            f"Give the seconds a training job has to checkpoint when stopped (e.g. "
            f"{DEFAULT_SIGNAL_GRACE})",
        )
    return grace


# torchrun forwards SIGTERM to its ranks, then kills them after this many seconds (30 unless
# set; torch releases older than the variable, pytorch/pytorch#172596, always wait 30 s).
TORCHRUN_SHUTDOWN_TIMEOUT = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


def shutdown_env(job: JobSpec, grace: int) -> list[tuple[str, str]]:
    """The environment that gives a checkpointing job's ranks the whole grace under torchrun."""
    if job.checkpoint_exit_code is None:
        return []
    return [(TORCHRUN_SHUTDOWN_TIMEOUT, str(grace))]


# torchrun as the job programs' refusals need it (launcher_scripts/jobs/torchrun.py): named, not
# imported, as the stages name job programs.
TORCHRUN = "launcher_scripts.jobs.torchrun"


def python_argv(command: Command, python: str = "python3") -> list[str]:
    """The argv that starts a command's program on this machine, through torchrun (TORCHRUN)
    when it has several processes."""
    argv = [python, "-u", "-m"]
    if command.nproc_per_node > 1:
        argv += [
            TORCHRUN,
            "--standalone",
            f"--nproc-per-node={command.nproc_per_node}",
        ]
        argv += ["-m"]
    return [*argv, command.module, *command.args]


def format_argv(argv: Sequence[str], indent: str = "    ") -> str:
    """Shell-quoted argv, one option and its values per line, for scripts people read."""
    quoted = [shlex.quote(arg) for arg in argv]
    return _option_lines(quoted, [arg.startswith("--") for arg in argv], indent)


def format_quoted(words: Sequence[str], indent: str = "    ") -> str:
    """Words already shell-quoted (some expand variables), laid out as format_argv does; a
    new line starts at each word beginning with "-"."""
    return _option_lines(words, [word.startswith("-") for word in words], indent)


def _option_lines(words: Sequence[str], starts_option: Sequence[bool], indent: str) -> str:
    lines: list[list[str]] = [[]]
    for position, (word, option) in enumerate(zip(words, starts_option, strict=True)):
        if position > 0 and option and lines[-1]:
            lines.append([])
        lines[-1].append(word)
    return (" \\\n" + indent).join(" ".join(line) for line in lines)


def export_lines(env: Iterable[tuple[str, str]]) -> list[str]:
    """`export NAME=value` lines; names are checked where the configuration gives them (see
    launcher_scripts.stages.base.common_env), values single-quoted."""
    return [f"export {name}={shlex.quote(value)}" for name, value in env]


@dataclass(frozen=True)
class ShellVar:
    """A parameter expansion the shell does when the script runs, e.g. ShellVar("SLURM_JOB_ID")
    or ShellVar("SLURM_RESTART_COUNT:-0")."""

    expression: str


def shell_word(*parts: str | ShellVar) -> str:
    """One shell word of literal text and expansions: each literal part single-quoted (where it
    needs quotes at all) and each expansion double-quoted, side by side, so a `$(...)` or a
    backtick in a configured path stays text while `${SLURM_JOB_ID}` still expands."""
    words: list[str] = []
    literal = ""
    for part in parts:
        if isinstance(part, ShellVar):
            words += [shlex.quote(literal)] if literal else []
            words.append(f'"${{{part.expression}}}"')
            literal = ""
        else:
            literal += part
    if literal or not words:
        words.append(shlex.quote(literal))
    return "".join(words)


def refuse_companions(jobs: Sequence[JobSpec], backend: str) -> None:
    """ConfigError for a job with companions on a backend that does not start them."""
    for job in jobs:
        if job.companions:
            names = ", ".join(c.name for c in job.companions)
            raise ConfigError(
                job.companions[0].key or f"{job.stage}",
                f"job {job.name} runs {names} beside it as jobs of their own, which "
                f"cluster_type={backend} does not start in this version",
                "Use cluster_type=bcm (Slurm) or local, or run the roles in one job "
                "(rlhf.layout=colocated)",
            )


def time_limit_seconds(limit: str, key: str) -> int:
    """Slurm's time formats (as the recipes write them) in seconds: "MM", "MM:SS",
    "HH:MM:SS", "D-HH", "D-HH:MM", "D-HH:MM:SS"."""
    text = str(limit).strip()
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not match:
        raise ConfigError(key, f"{limit!r} is not a time limit", 'Use "HH:MM:SS" or "D-HH:MM:SS"')
    days, first, second, third = match.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = int(first), int(second or 0), int(third or 0)
    elif third is not None:  # HH:MM:SS
        hours, minutes, seconds = int(first), int(second), int(third)
    else:  # MM[:SS]
        hours, minutes, seconds = 0, int(first), int(second or 0)
    total = ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds
    if total < 1:
        raise ConfigError(key, f"{limit!r} is no time at all", 'Use e.g. "04:00:00"')
    return total


# Where a job's companions log, under its results folder: one <name>.log each.
COMPANION_LOGS = "companions"


def with_companions(
    main: str,
    companions: Sequence[tuple[str, str]],
    log_dir: str,
    signals: Sequence[tuple[str, str]],
) -> list[str]:
    """Bash that runs a job's companions (name, their command line) in the background, each
    logging to `<log_dir>/<name>.log`, then its main command line; each of `signals`
    (received, sent) the script receives goes to the main program as the signal sent. The main
    program's end ends the companions and the script with its exit code; a companion that
    fails first ends the run with one line naming it and exit code 1 (one that exits 0 was
    told to stop). Portable to bash 4 (no `wait -n -p`)."""
    lines = [
        "",
        "# The job's companions, each with its own log; the main program after them.",
        f"companion_logs={shlex.quote(log_dir)}",
        'mkdir -p "$companion_logs"',
        "declare -A companion=()",
    ]
    for name, command in companions:
        log = f'"$companion_logs"/{shlex.quote(name + ".log")}'
        lines += ["", f"{command} \\\n    >{log} 2>&1 &", f"companion[$!]={shlex.quote(name)}"]
    lines += ["", f"{main} &", "main=$!"]
    for received, sent in signals:
        lines.append(f"trap 'kill -s {sent} \"$main\" 2>/dev/null || true' {received}")
    lines += [
        "end_companions() {",
        "    local pid",
        '    for pid in "${!companion[@]}"; do kill -s TERM "$pid" 2>/dev/null || true; done',
        "    wait || true",
        "}",
        'while kill -0 "$main" 2>/dev/null; do',
        '    for pid in "${!companion[@]}"; do',
        '        kill -0 "$pid" 2>/dev/null && continue',
        "        code=0",
        '        wait "$pid" || code=$?',
        "        name=${companion[$pid]}",
        '        unset "companion[$pid]"',
        "        ((code == 0)) && continue",
        "        echo \"error: the job's $name ended with exit code $code while the main program"
        ' ran: the run stops (its log: $companion_logs/$name.log)" >&2',
        '        kill -s TERM "$main" 2>/dev/null || true',
        "        end_companions",
        "        exit 1",
        "    done",
        "    sleep 1",
        "done",
        "code=0",
        'wait "$main" || code=$?',
        "end_companions",
        'exit "$code"',
    ]
    return lines
