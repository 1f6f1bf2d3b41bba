"""Slurm (`cluster_type=bcm`): sbatch scripts with srun steps, pyxis containers when set.

Rendering is pure: the cluster section of the config and a JobSpec give the script, byte for
byte the same each time. Submission, status and cancel call sbatch, squeue/sacct and scancel.
"""

from __future__ import annotations

import functools
import glob
import json
import shlex
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from launcher_scripts.clusters.base import (
    COMPANION_LOGS,
    BackendDefaults,
    JobLog,
    JobRecord,
    ShellVar,
    check_gpus_per_node,
    export_lines,
    format_argv,
    nodes_key,
    shell_word,
    utc_now,
    with_companions,
)
from launcher_scripts.clusters.slurm_nodes import SinfoAnswer, SlurmNodes, ask_sinfo
from launcher_scripts.clusters.slurm_settings import slurm_settings
from launcher_scripts.clusters.unhealthy import Unhealthy, unhealthy_nodes
from launcher_scripts.errors import ConfigError, LauncherError
from launcher_scripts.jobspec import MAIN_HOST_VARIABLE, Command, Companion, JobSpec

# Signals srun forwards to the tasks of its step; the batch shell forwards this one to srun.
CHECKPOINT_SIGNAL = "USR1"
# What `launcher_scripts cancel` sends the batch shell of a checkpointing job: it forwards the
# checkpoint signal and, once the step has saved and exited, ends the job without requeueing
# it (USR1 alone, from --signal before the time limit or a preemption, requeues).
CANCEL_SIGNAL = "USR2"


def attempt_log_parts(
    job: str, job_id: str | ShellVar, attempt: str | ShellVar
) -> list[str | ShellVar]:
    """The log of one attempt of a requeueable job (the script redirects into it), in parts:
    the script names it with the job id and attempt still to expand."""
    return ["log-", job, "_", job_id, "_attempt", attempt, ".out"]


def attempt_log_name(job: str, job_id: str, attempt: str) -> str:
    return "".join(str(part) for part in attempt_log_parts(job, job_id, attempt))


def excluded_nodes_name(job: str, job_id: str | ShellVar) -> list[str | ShellVar]:
    """The JSON file in which a multi-node training job keeps the nodes its requeues left out
    (jobs/failed_node.py writes it; status shows it), in parts like attempt_log_parts."""
    return ["excluded_nodes-", job, "_", job_id, ".json"]


def _attempt_log(job: JobSpec) -> str:
    """The shell word of a checkpointing job's log: one per attempt (a requeued job keeps its
    id, so the attempt is in the name)."""
    name = attempt_log_parts(job.name, ShellVar("SLURM_JOB_ID"), ShellVar("SLURM_RESTART_COUNT:-0"))
    return shell_word(f"{Path(job.results_dir)}/", *name)


def slurm_log_name(job: str, job_id: str, task: str | None = None) -> str:
    """The file sbatch's --output names: per array task when `task` is given."""
    return f"slurm-{job}_{job_id}" + ("" if task is None else f"_{task}") + ".out"


def _number_in(file_name: str, template: str) -> int | None:
    """N where `file_name` is `template` with N in place of its one NUL character."""
    head, _, tail = template.partition("\0")
    middle = file_name[len(head) : len(file_name) - len(tail)]
    matches = file_name.startswith(head) and file_name.endswith(tail)
    return int(middle) if matches and middle.isdigit() else None


# An sbatch option: (name, value or None for a flag, the key that sets it).
Option = tuple[str, "str | None", str]


def _sbatch(options: Sequence[Option]) -> list[str]:
    return [
        f"#SBATCH --{name}"
        if value is None
        else f"#SBATCH --{name}={shlex.quote(one_line(key, value))}"
        for name, value, key in options
    ]


def slurm_time(limit: str, key: str) -> str:
    """NeMo writes "0:30:00" or "1-00:00:00"; Slurm takes both as they are, so check only."""
    text = str(limit).strip()
    if not text or any(c not in "0123456789:-" for c in text):
        raise ConfigError(key, f"{limit!r} is not a Slurm time", 'Use "HH:MM:SS" or "D-HH:MM:SS"')
    return text


def one_line(key: str, value: str) -> str:
    """`value` for an #SBATCH line, which sbatch reads with shell-like quoting up to the end of
    the line: a newline would end the directive and put the rest in the script's body."""
    if any(ord(char) < 32 or ord(char) == 127 for char in value):
        raise ConfigError(
            key,
            f"{value!r} holds a control character (a newline, say), which an #SBATCH line "
            "cannot hold",
            "Remove it",
        )
    return value


def check_output_path(key: str, value: str) -> None:
    """sbatch expands `%` patterns in the --output file name (and a backslash turns them off),
    so the log would not be where the launcher looks for it."""
    for char in "%\\":
        if char in value:
            raise ConfigError(
                key,
                f"{value!r} holds {char!r}, which Slurm reads as part of a file-name pattern in "
                "the job's --output file",
                f"Remove the {char!r}",
            )


def check_mount(key: str, value: str, own_destination: bool) -> None:
    """pyxis's --container-mounts is a comma-separated list of SRC[:DST[:FLAGS]]: a comma
    splits an entry, and a colon in a path it mounts at itself would be read as SRC:DST."""
    if "," in value:
        raise ConfigError(
            key,
            f"{value!r} holds a comma, which splits pyxis's --container-mounts list",
            "Use a path without commas (a symbolic link to it, say)",
        )
    if own_destination and ":" in value:
        raise ConfigError(
            key,
            f"{value!r} holds a colon, which pyxis's --container-mounts reads as SRC:DST",
            "Use a path without colons (a symbolic link to it, say)",
        )


class SlurmBackend(BackendDefaults):
    name = "bcm"
    synchronous = False

    def __init__(self, root: Any = None) -> None:
        """`root` is the resolved config; status and cancel need none."""
        self.root = root
        self.settings = slurm_settings(root.cluster if root is not None else None)
        self.unhealthy: Unhealthy | None = None
        if self.settings.validation_results is not None:
            self.unhealthy = unhealthy_nodes(self.settings.validation_results)

    @functools.cached_property
    def sinfo(self) -> SinfoAnswer:
        """What sinfo says of the cluster's partitions and nodes, asked once."""
        return ask_sinfo()

    @property
    def cluster_nodes(self) -> SlurmNodes | None:
        """The cluster's partitions and nodes where sinfo answers, else None."""
        return self.sinfo.nodes

    def drained(self) -> list[str]:
        """The nodes validation drains that this cluster has: sbatch refuses an --exclude
        naming a node it does not know (a verdict of another cluster, a node since removed).
        All of them where sinfo does not answer."""
        if self.unhealthy is None:
            return []
        cluster = self.cluster_nodes if self.unhealthy.nodes else None
        if cluster is None:
            return list(self.unhealthy.nodes)
        return [node for node in self.unhealthy.nodes if node in cluster.known]

    def excluded(self) -> str:
        """Every submission's --exclude: cluster.exclude and the nodes validation drains."""
        parts = [self.settings.exclude, *self.drained()]
        return ",".join(part for part in parts if part)

    def plan_notes(self) -> list[str]:
        """What a run says about this cluster before its jobs."""
        if self.unhealthy is None:
            return []
        drained = self.drained()
        notes = [
            f"cluster: exclude_unhealthy: every job excludes the nodes to drain in "
            f"{self.unhealthy.verdict}: {', '.join(drained) or 'none'}"
        ]
        unknown = [node for node in self.unhealthy.nodes if node not in drained]
        if unknown:
            notes.append(
                f"cluster: exclude_unhealthy: left out {', '.join(unknown)}, which "
                f"{self.unhealthy.verdict} drains but this cluster does not have (sinfo lists "
                "no such node; sbatch would refuse the --exclude)"
            )
        return notes

    def jobs_use_launcher_environment(self) -> bool:
        # Without a container, the nodes run the launcher's installation (a shared file system).
        return not (self.root is not None and self.root.get("container"))

    # ----- checks before submitting -----------------------------------------------------

    def check_jobs(self, jobs: Sequence[JobSpec]) -> None:
        """A job asking for more nodes than its partition has, or than are left of it once
        cluster.exclude and the nodes validation drains are taken out, would wait forever
        (PENDING, PartitionNodeLimit) or be refused by sbatch. Checked where sinfo answers;
        an unknown partition is check_submission's to name."""
        check_gpus_per_node(jobs, self.settings.gpus_per_node, "cluster.gpus_per_node")
        cluster = self.cluster_nodes
        partition = cluster.partition(self.settings.partition) if cluster else None
        if partition is None:
            return
        excluded_here = set(_node_names(self.settings.exclude)) & set(partition.nodes)
        drained_here = [node for node in self.drained() if node in partition.nodes]
        left = [n for n in partition.nodes if n not in excluded_here and n not in drained_here]
        for job in jobs:
            asked, key = job.resources.nodes, nodes_key(job)
            where = f"partition {partition.name}"
            limit = partition.max_job_nodes
            if limit is not None and asked > limit:
                raise ConfigError(
                    key,
                    f"job {job.name} asks for {asked} nodes but {where} takes jobs of at most "
                    f"{limit} (its MaxNodes)",
                    f"Set {key}={limit} or fewer, or use another partition (cluster.partition)",
                )
            if asked > len(partition.nodes):
                raise ConfigError(
                    key,
                    f"job {job.name} asks for {asked} nodes but {where} has "
                    f"{len(partition.nodes)} ({', '.join(partition.nodes)}): Slurm would keep "
                    "it pending forever (PartitionNodeLimit)",
                    f"Set {key}={len(partition.nodes)} or fewer, or use a partition with more "
                    "nodes (cluster.partition; sinfo lists them)",
                )
            if asked > len(left):
                raise self._too_few_left(job, where, partition.nodes, left, drained_here)
            whole = asked + sum(c.resources.nodes for c in job.companions)
            apart = self.settings.companion_partition not in (None, self.settings.partition)
            if job.companions and not apart and whole > len(left):
                names = ", ".join(c.name for c in job.companions)
                raise ConfigError(
                    job.companions[0].key or key,
                    f"job {job.name} and its {names} need {whole} nodes (each part of a "
                    f"heterogeneous job has nodes of its own) but {where} has {len(left)} to "
                    "give: Slurm would keep it pending forever",
                    "Use a partition with more nodes, give the companions their own "
                    "(cluster.companion_partition), or run the roles in one job",
                )

    def _too_few_left(
        self,
        job: JobSpec,
        where: str,
        nodes: tuple[str, ...],
        left: list[str],
        drained: list[str],
    ) -> ConfigError:
        asked, key = job.resources.nodes, nodes_key(job)
        remaining = (
            f"which leaves none of {where}'s {len(nodes)} nodes"
            if not left
            else f"which leaves {len(left)} of {where}'s {len(nodes)} nodes "
            f"({', '.join(left)}) for job {job.name}'s {asked}"
        )
        fewer = f", ask for fewer nodes ({key}={len(left)})" if left else ""
        if not drained:
            return ConfigError(
                "cluster.exclude",
                f"excludes {self.settings.exclude}, {remaining}",
                f"Exclude fewer nodes{fewer}, or use another partition (cluster.partition)",
            )
        assert self.unhealthy is not None
        also = f" (and cluster.exclude {self.settings.exclude})" if self.settings.exclude else ""
        return ConfigError(
            "cluster.exclude_unhealthy",
            f"{self.unhealthy.verdict} drains {', '.join(drained)}{also}, {remaining}",
            f"Repair those nodes and validate the cluster again{fewer}, use another partition "
            "(cluster.partition), or set cluster.exclude_unhealthy=false",
        )

    def check_submission(self, jobs: Sequence[JobSpec]) -> None:
        if shutil.which("sbatch") is None:
            raise ConfigError(
                "cluster_type",
                "is bcm but sbatch is not on PATH",
                "Run from a Slurm login node, or use cluster_type=local, or dry_run=true",
            )
        if self.cluster_nodes is None:
            # sbatch would fail after earlier stages' jobs had been written, or submitted.
            problem = self.sinfo.problem or "sinfo is not on PATH"
            raise ConfigError(
                "cluster_type",
                f"is bcm but Slurm does not answer ({problem})",
                "Check that slurmctld is up (scontrol ping) and that SLURM_CONF names this "
                "cluster's slurm.conf, or use dry_run=true to render the scripts",
            )
        known = list(self.cluster_nodes.partitions)
        # Slurm takes a list, "a,b": the job runs in whichever can start it first.
        for key in ("partition", "companion_partition"):
            for partition in (getattr(self.settings, key) or "").split(","):
                if partition and known and partition not in known:
                    raise ConfigError(
                        f"cluster.{key}",
                        f"{partition!r} is not a partition of this cluster",
                        f"Use one of: {', '.join(sorted(set(known)))}",
                    )
        self._check_cpus(jobs)
        if self.root.container:
            if "--container-image" not in _run(["srun", "--help"]):
                raise ConfigError(
                    "container",
                    "is set but this cluster's srun has no pyxis (--container-image)",
                    "Install the pyxis plugin, or set container=null to run on the hosts",
                )
            for index, mount in enumerate(self.root.container_mounts or ()):
                source = str(mount).split(":")[0]
                if not Path(source).exists():
                    raise ConfigError(
                        f"container_mounts[{index}]",
                        f"{source} does not exist on this node",
                        "Fix the path or create it",
                    )

    def _check_cpus(self, jobs: Sequence[JobSpec]) -> None:
        """A job asking for more CPUs per node than any node has would wait forever (PENDING,
        reason PartitionConfig or Resources); say so now instead."""
        partition = self.settings.partition
        # One line per node (-N), so each count is exact rather than a "128+" summary.
        argv = ["sinfo", "-h", "-N", "-o", "%c"] + (["-p", partition] if partition else [])
        counts = [int(word) for word in _run(argv).split() if word.isdigit()]
        if not counts:
            return
        largest = max(counts)
        for job in jobs:
            per_task = job.resources.cpus_per_task
            if per_task and per_task * job.resources.ntasks_per_node > largest:
                raise ConfigError(
                    f"{job.stage}.run.cpus_per_node",
                    f"job {job.name} asks for {per_task * job.resources.ntasks_per_node} CPUs "
                    f"per node but the largest node of "
                    f"{'partition ' + str(partition) if partition else 'this cluster'} has "
                    f"{largest}",
                    f"Set {job.stage}.run.cpus_per_node={largest} or lower (null asks for none)",
                )

    # ----- rendering -------------------------------------------------------------------

    def log_path(self, job: JobSpec, run_id: str) -> str:
        return str(Path(job.results_dir) / f"log-{job.name}_{run_id}.out")

    def _sbatch_lines(self, job: JobSpec) -> list[str]:
        settings, resources = self.settings, job.resources
        prefix = settings.job_name_prefix
        output = (
            slurm_log_name(job.name, "%A", "%a")
            if job.array_size
            else slurm_log_name(job.name, "%j")
        )
        check_output_path(f"{job.stage}.run.results_dir", job.results_dir)
        check_output_path(f"{job.stage}.run.name", job.name)
        time_key = f"{job.stage}.run.time_limit"
        # (option, value, the key that sets it): None is a flag without a value.
        options: list[tuple[str, str | None, str]] = [
            ("job-name", f"{prefix}{job.name}", "cluster.job_name_prefix"),
            ("nodes", str(resources.nodes), f"{job.stage}.run"),
            ("ntasks-per-node", str(resources.ntasks_per_node), f"{job.stage}.run"),
            ("time", slurm_time(resources.time_limit, time_key), time_key),
            ("output", str(Path(job.results_dir) / output), f"{job.stage}.run.results_dir"),
        ]
        for name, value in settings.direct_options():
            options.append((name, value, f"cluster.{name}"))
        if self.excluded():
            key = "cluster.exclude_unhealthy" if self.unhealthy else "cluster.exclude"
            options.append(("exclude", self.excluded(), key))
        if resources.cpus_per_task:
            options.append(("cpus-per-task", str(resources.cpus_per_task), f"{job.stage}.run"))
        if resources.gpus_per_node:
            if settings.gpus_per_node_option:
                options.append(("gpus-per-node", str(resources.gpus_per_node), f"{job.stage}"))
            if settings.gpus_per_task is not None:
                options.append(("gpus-per-task", settings.gpus_per_task, "cluster.gpus_per_task"))
            if settings.mem is not None:
                options.append(("mem", settings.mem, "cluster.mem"))
        if resources.exclusive and settings.exclusive:
            options.append(("exclusive", None, "cluster.exclusive"))
        if settings.overcommit:
            options.append(("overcommit", None, "cluster.overcommit"))
        if job.array_size:
            options.append(("array", f"0-{job.array_size - 1}", f"{job.stage}"))
        if job.checkpoint_exit_code is not None:
            options.append(
                (
                    "signal",
                    f"B:{CHECKPOINT_SIGNAL}@{settings.signal_grace_seconds}",
                    "cluster.signal_grace_seconds",
                )
            )
            if not job.companions:  # a heterogeneous job ends with its checkpoint, unrequeued
                options += [
                    ("requeue", None, "cluster.max_restarts"),
                    ("open-mode", "append", "cluster.max_restarts"),
                ]
        for name, value in settings.sbatch_options:
            options.append((name, value, f"cluster.sbatch_options.{name}"))
        lines = _sbatch(options)
        for companion in job.companions:
            lines += ["#SBATCH hetjob", *_sbatch(self._component_options(job, companion))]
        return lines

    def _component_options(self, job: JobSpec, companion: Companion) -> list[Option]:
        """A companion's component of the heterogeneous job: its nodes and tasks, and what
        the cluster section asks of every allocation."""
        settings, resources = self.settings, companion.resources
        options: list[Option] = [
            ("nodes", str(resources.nodes), companion.key),
            ("ntasks-per-node", str(resources.ntasks_per_node), companion.key),
            ("time", slurm_time(resources.time_limit, f"{job.stage}.run.time_limit"), ""),
        ]
        for name, value in settings.direct_options():
            if name == "partition" and settings.companion_partition:
                options.append((name, settings.companion_partition, "cluster.companion_partition"))
            else:
                options.append((name, value, f"cluster.{name}"))
        if settings.companion_partition and not settings.partition:
            options.append(
                ("partition", settings.companion_partition, "cluster.companion_partition")
            )
        if resources.gpus_per_node and settings.gpus_per_node_option:
            options.append(("gpus-per-node", str(resources.gpus_per_node), companion.key))
        if resources.exclusive and settings.exclusive:
            options.append(("exclusive", None, "cluster.exclusive"))
        return options

    def _container_flags(self, job: JobSpec) -> list[str]:
        if not job.container:
            return []
        root = self.root
        mounts = []
        for key in ("launcher_scripts_path", "data_dir", "base_results_dir"):
            check_mount(key, str(root[key]), own_destination=True)
            mounts.append(str(root[key]))
        for index, mount in enumerate(job.container_mounts):
            check_mount(f"container_mounts[{index}]", mount, own_destination=False)
            mounts.append(mount)
        unique = list(dict.fromkeys(mounts))
        return [
            f"--container-image={job.container}",
            f"--container-mounts={','.join(unique)}",
            f"--container-workdir={job.results_dir}",
            "--no-container-mount-home",
        ]

    def _srun_argv(self, job: JobSpec, command_argv: list[str], tasks_per_node: int) -> list[str]:
        argv = ["srun", f"--ntasks-per-node={tasks_per_node}", "--kill-on-bad-exit=1"]
        argv += self._container_flags(job)
        argv += self.settings.srun_args
        return argv + command_argv

    def render(self, job: JobSpec) -> str:
        if job.companions:
            return self._render_with_companions(job)
        lines = [
            "#!/usr/bin/env bash",
            f"# Stage {job.stage}, job {job.name}: rendered by launcher_scripts (Slurm backend).",
            *self._sbatch_lines(job),
            "set -euo pipefail",
        ]
        log = ""
        if job.checkpoint_exit_code is not None:
            log = _attempt_log(job)
            lines.append(f"exec >>{log} 2>&1")
        lines += [
            "",
            f"export PYTHONPATH={shlex.quote(job.pythonpath)}${{PYTHONPATH:+:${{PYTHONPATH}}}}",
            *export_lines(job.env),
            # The first node hosts the rendezvous; the port follows the job id, so two jobs
            # sharing a node do not collide.
            'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
            "MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
            "export MASTER_ADDR MASTER_PORT",
            f"cd {shlex.quote(job.results_dir)}",
        ]
        for command in job.commands:
            program = ["python3", "-u", "-m", command.module, *command.args]
            srun = self._srun_argv(job, program, command.nproc_per_node)
            if job.checkpoint_exit_code is None:
                lines += ["", format_argv(srun)]
            else:
                lines += ["", *self._restartable_step(job, srun, log)]
        return "\n".join(lines) + "\n"

    def _render_with_companions(self, job: JobSpec) -> str:
        """One heterogeneous job: the job's own program in component 0, each companion in a
        component of its own; each component's processes meet on its first node."""
        lines = [
            "#!/usr/bin/env bash",
            f"# Stage {job.stage}, job {job.name}: rendered by launcher_scripts (Slurm backend).",
            "# A heterogeneous job: the main program, and "
            + ", ".join(c.name for c in job.companions)
            + " beside it.",
            *self._sbatch_lines(job),
            "set -euo pipefail",
        ]
        if job.checkpoint_exit_code is not None:  # where `logs` looks, as for other such jobs
            lines.append(f"exec >>{_attempt_log(job)} 2>&1")
        lines += [
            "",
            f"export PYTHONPATH={shlex.quote(job.pythonpath)}${{PYTHONPATH:+:${{PYTHONPATH}}}}",
            *export_lines(job.env),
            "port=$((20000 + SLURM_JOB_ID % 20000))",
            # The companions reach the main program's node by the route to it.
            f'{MAIN_HOST_VARIABLE}="$(scontrol show hostnames '
            '"$SLURM_JOB_NODELIST_HET_GROUP_0" | head -n 1)"',
            f"export {MAIN_HOST_VARIABLE}",
            f"cd {shlex.quote(job.results_dir)}",
        ]

        def step(group: int, command: Command) -> str:
            program = ["python3", "-u", "-m", command.module, *command.args]
            srun = self._srun_argv(job, program, command.nproc_per_node)
            srun.insert(1, f"--het-group={group}")
            first = (
                f'"$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_{group}" | head -n 1)"'
            )
            return f"MASTER_ADDR={first} MASTER_PORT=$((port + {group})) \\\n    " + format_argv(
                srun
            )

        *before, last = job.commands
        for command in before:
            lines += ["", step(0, command)]
        companions = [(c.name, step(i, c.command)) for i, c in enumerate(job.companions, 1)]
        log_dir = str(Path(job.results_dir) / COMPANION_LOGS)
        # The checkpoint signal (before the time limit) and the launcher's cancel both ask the
        # main program to save and stop; its end ends the companions.
        signals = ((CHECKPOINT_SIGNAL, CHECKPOINT_SIGNAL), (CANCEL_SIGNAL, CHECKPOINT_SIGNAL))
        lines += with_companions(step(0, last), companions, log_dir, (*signals, ("TERM", "TERM")))
        return "\n".join(lines) + "\n"

    def _restartable_step(self, job: JobSpec, srun: list[str], log: str) -> list[str]:
        """Run the step in the background so the batch shell can forward the signal, then
        requeue when the program checkpointed on it and made progress since the last attempt;
        after a cancel (CANCEL_SIGNAL), end the job instead. A multi-node step that failed
        on one node is requeued without that node (`_requeue_without_failed_node`)."""
        progress = ["python3", "-m", "launcher_scripts.formats.progress"]
        progress.append(str(job.progress_dir))
        max_restarts = self.settings.max_restarts
        forward = (
            f'if [ -n "$step_pid" ]; then kill -{CHECKPOINT_SIGNAL} "$step_pid" 2>/dev/null '
            "|| true; fi"
        )
        return [
            "step_pid=",
            "cancelled=0",
            "stop_asked=0",
            f"trap 'stop_asked=1; echo \"launcher: {CHECKPOINT_SIGNAL} received, asking the job "
            f"step to checkpoint\"; {forward}' {CHECKPOINT_SIGNAL}",
            f"trap 'cancelled=1; echo \"launcher: cancel requested, asking the job step to "
            f"checkpoint and stop\"; {forward}' {CANCEL_SIGNAL}",
            f"step_before=$({shlex.join(progress)})",
            'if [ "$cancelled" -eq 1 ]; then',
            '    echo "launcher: cancelled before the job step started"',
            '    scancel "$SLURM_JOB_ID"',
            "    exit 0",
            "fi",
            f"{format_argv(srun)} &",
            "step_pid=$!",
            "set +e",
            "while :; do",
            '    wait "$step_pid"; code=$?',
            '    kill -0 "$step_pid" 2>/dev/null || break  # wait was interrupted by the trap',
            "done",
            "set -e",
            f"step_after=$({shlex.join(progress)})",
            'if [ "$cancelled" -eq 1 ] && [ "$code" -ne 0 ]; then',
            '    echo "launcher: cancelled (exit code $code); newest checkpoint at step '
            '$step_after; not requeued"',
            # The job ends CANCELLED, as the user asked, not FAILED with the step's code.
            '    scancel "$SLURM_JOB_ID"',
            '    exit "$code"',
            "fi",
            # srun exits with the highest of its tasks' codes, and --kill-on-bad-exit ends the
            # other tasks once the first has stopped with the checkpoint code: after the
            # signal, a step that ended with any failure stopped on it (a new checkpoint is
            # still needed to requeue).
            "on_signal=0",
            f'if [ "$code" -eq {job.checkpoint_exit_code} ] || '
            '{ [ "$stop_asked" -eq 1 ] && [ "$code" -ne 0 ]; }; then',
            "    on_signal=1",
            "fi",
            'if [ "$on_signal" -eq 1 ]; then',
            f'    if [ "${{SLURM_RESTART_COUNT:-0}}" -ge {max_restarts} ]; then',
            f'        echo "launcher: not requeued: max_restarts ({max_restarts}) reached"',
            '    elif [ "$step_after" -le "$step_before" ]; then',
            '        echo "launcher: not requeued: no new checkpoint since the last attempt"',
            "    else",
            '        echo "launcher: checkpoint at step $step_after; requeueing"',
            '        scontrol requeue "$SLURM_JOB_ID"',
            "        exit 0",
            "    fi",
            "fi",
            *(self._requeue_without_failed_node(job, log) if job.resources.nodes > 1 else []),
            'exit "$code"',
        ]

    def _requeue_without_failed_node(self, job: JobSpec, log: str) -> list[str]:
        """After a failure that srun pins on one node (a task killed there, the node lost),
        not a stop the checkpoint signal asked for, with a new checkpoint since the attempt
        started: requeue, excluding that node.

        Slurm takes a new ExcNodeList only from a pending job, and `scontrol requeue` makes
        this one pending (still completing: it cannot start again before this shell exits),
        so the shell requeues first, ignoring the SIGTERM that ends the attempt, and then
        sets the list."""
        max_restarts = self.settings.max_restarts
        record = shell_word(
            f"{Path(job.results_dir)}/", *excluded_nodes_name(job.name, ShellVar("SLURM_JOB_ID"))
        )
        failed_node = [
            *("python3", "-m", "launcher_scripts.jobs.failed_node", "--log"),
            *(log, "--record", record, "--attempt", '"${SLURM_RESTART_COUNT:-0}"'),
        ]
        if self.excluded():
            failed_node += ["--exclude", shlex.quote(self.excluded())]
        return [
            'if [ "$code" -ne 0 ] && [ "$on_signal" -eq 0 ]; then',
            f'    if [ "${{SLURM_RESTART_COUNT:-0}}" -ge {max_restarts} ]; then',
            f'        echo "launcher: not requeued after the failure: max_restarts '
            f'({max_restarts}) reached"',
            '    elif [ "$step_after" -le "$step_before" ]; then',
            '        echo "launcher: not requeued after the failure: no new checkpoint since '
            'the attempt started"',
            f"    elif exclude=$({' '.join(failed_node)}); then",
            '        echo "launcher: checkpoint at step $step_after; requeueing without the '
            'failed node (ExcNodeList=$exclude)"',
            "        trap '' TERM",
            '        scontrol requeue "$SLURM_JOB_ID"',
            "        for _ in $(seq 20); do",
            '            if scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$exclude"; then',
            "                exit 0",
            "            fi",
            "            sleep 1",
            "        done",
            '        echo "launcher: requeued, but Slurm refused ExcNodeList=$exclude: the '
            'next attempt may start on the failed node"',
            "        exit 0",
            "    fi",
            "fi",
        ]

    # ----- submission ------------------------------------------------------------------

    def submit(
        self,
        script: str,
        job: JobSpec,
        record: JobRecord,
        after: Sequence[str],
        on_start: Callable[[JobRecord], None],
    ) -> None:
        argv = ["sbatch", "--parsable", "--kill-on-invalid-dep=yes"]
        dependencies = []
        if after:
            kind = job.dependency if job.dependency in ("afterany", "aftercorr") else "afterok"
            dependencies.append(f"{kind}:{':'.join(after)}")
        if job.dependency == "singleton":
            dependencies.append("singleton")
        if dependencies:
            argv.append(f"--dependency={','.join(dependencies)}")
        argv.append(script)
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise LauncherError(f"sbatch failed for {job.name}: {result.stderr.strip()}")
        job_id = result.stdout.strip().split(";")[0]
        record.job_ids = [job_id]
        record.checkpoint_exit_code = job.checkpoint_exit_code
        record.grace_seconds = self.settings.signal_grace_seconds
        record.log = str(self._first_log(job, job_id))
        record.state = "PENDING"
        record.start = utc_now()
        on_start(record)

    @staticmethod
    def _first_log(job: JobSpec, job_id: str) -> Path:
        """The log Slurm writes for the job (its first array task, its first attempt)."""
        folder = Path(job.results_dir)
        if job.checkpoint_exit_code is not None:
            return folder / attempt_log_name(job.name, job_id, "0")
        if job.array_size:
            return folder / slurm_log_name(job.name, job_id, "0")
        return folder / slurm_log_name(job.name, job_id)

    def refresh(self, record: JobRecord) -> None:
        if record.job_ids:
            name = excluded_nodes_name(record.name, record.job_ids[0])
            kept = Path(record.log).parent / "".join(str(part) for part in name)
            try:
                excluded = json.loads(kept.read_text())
            except (OSError, ValueError):
                excluded = None
            if isinstance(excluded, dict):
                record.excluded_nodes = excluded
        for job_id in record.job_ids:
            state, exit_code = _squeue_state(job_id), None
            if state is None:
                state, exit_code = _sacct_status(job_id)
            if state:
                record.state = state
            # A job cancelled before it ran reports 0:0, which is no exit code of its own.
            if exit_code is not None and state in ("COMPLETED", "FAILED"):
                record.exit_code = exit_code

    def cancel(self, record: JobRecord) -> int | None:
        """A running job that checkpoints: its batch shell gets CANCEL_SIGNAL (it forwards the
        checkpoint signal to the step and ends the job, not requeued, once the step exits);
        the caller ends it after its grace. Any other job: scancel now."""
        if not record.job_ids:
            return None
        graceful = record.checkpoint_exit_code is not None and len(record.job_ids) == 1
        if graceful and _squeue_state(record.job_ids[0]) == "RUNNING":
            signalled = subprocess.run(
                ["scancel", "--batch", f"--signal={CANCEL_SIGNAL}", record.job_ids[0]],
                capture_output=True,
                timeout=60,
            )
            if signalled.returncode == 0:
                return record.grace_seconds or self.settings.signal_grace_seconds
        self.end(record)
        return None

    def stopped(self, record: JobRecord) -> bool:
        """Gone from the queue, or ended (a requeued job is pending again: not stopped)."""
        states = [_squeue_state(job_id) for job_id in record.job_ids]
        return all(state in (None, "COMPLETED", "FAILED", "CANCELLED") for state in states)

    def end(self, record: JobRecord) -> None:
        if record.job_ids:
            subprocess.run(["scancel", *record.job_ids], capture_output=True, timeout=60)

    def logs(self, record: JobRecord) -> list[JobLog]:
        """The files the job's script names: one per array task (`_%A_%a`), one per attempt of a
        requeueable job (`_attempt<N>`), else the one `_%j` file."""
        if not record.job_ids:
            return []
        folder, job_id = Path(record.log).parent, record.job_ids[0]
        found = []
        attempts = attempt_log_name(record.name, job_id, "\0")
        tasks = slurm_log_name(record.name, job_id, "\0")
        for path in folder.glob(f"*{glob.escape(record.name)}_{job_id}*.out"):
            if (attempt := _number_in(path.name, attempts)) is not None:
                found.append(JobLog(path, attempt=attempt))
            elif (task := _number_in(path.name, tasks)) is not None:
                found.append(JobLog(path, task=task))
            elif path.name == slurm_log_name(record.name, job_id):
                found.append(JobLog(path))
        return sorted(found, key=lambda log: (log.task or 0, log.attempt or 0))


SLURM_STATES = {
    "PENDING": "PENDING",
    "CONFIGURING": "PENDING",
    "REQUEUED": "PENDING",
    "RUNNING": "RUNNING",
    "COMPLETING": "RUNNING",
    "COMPLETED": "COMPLETED",
    "FAILED": "FAILED",
    "TIMEOUT": "FAILED",
    "NODE_FAIL": "FAILED",
    "OUT_OF_MEMORY": "FAILED",
    "PREEMPTED": "PENDING",
    "CANCELLED": "CANCELLED",
}


def _node_names(hostlist: str) -> list[str]:
    """The node names of a Slurm host list ("n1,n[3-4]"): scontrol expands ranges; without
    it, the plain names only."""
    if not hostlist:
        return []
    if "[" in hostlist:
        try:
            expanded = subprocess.run(
                ["scontrol", "show", "hostnames", hostlist],
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired):
            expanded = None
        if expanded is not None and expanded.returncode == 0:
            return expanded.stdout.split()
    return [name.strip() for name in hostlist.split(",") if name.strip() and "[" not in name]


def _run(argv: list[str]) -> str:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return result.stdout + result.stderr


def _squeue_state(job_id: str) -> str | None:
    result = subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=60
    )
    states = [SLURM_STATES.get(s.split()[0], s) for s in result.stdout.split() if s]
    return _combined(states)


def _sacct_status(job_id: str) -> tuple[str | None, int | None]:
    """Finished jobs' state and exit code: from accounting, or from the job-completion file
    (`sacct -c`). An array's exit code is its first failing task's."""
    for extra in ([], ["-c"]):
        result = subprocess.run(
            ["sacct", *extra, "-n", "-X", "-P", "-j", job_id, "-o", "JobID,State,ExitCode"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        # A requeued job is listed once per attempt: its last line is its state now.
        latest: dict[str, tuple[str, int | None]] = {}
        for line in result.stdout.splitlines():
            if line.count("|") == 2:
                name, state, code = line.split("|")
                mapped = SLURM_STATES.get(state.split()[0], state) if state else state
                latest[name] = (mapped, _exit_code(code))
        if latest:
            codes = [code for _state, code in latest.values() if code is not None]
            failing = next((code for code in codes if code), codes[0] if codes else None)
            return _combined([state for state, _code in latest.values()]), failing
    return None, None


def _exit_code(text: str) -> int | None:
    """Slurm's "code:signal" as a shell reports it: the code, or 128 + the signal."""
    code, _, signal = text.partition(":")
    if not code.isdigit():
        return None
    return 128 + int(signal) if signal.isdigit() and int(signal) else int(code)


def _combined(states: list[str]) -> str | None:
    """An array's tasks as one state: any running or pending first, then any failure."""
    for state in ("RUNNING", "PENDING", "FAILED", "CANCELLED", "COMPLETED"):
        if state in states:
            return state
    return states[0] if states else None
