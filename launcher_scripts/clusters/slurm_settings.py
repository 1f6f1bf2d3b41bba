"""The Slurm cluster section (conf/cluster/bcm.yaml, `cluster_type=bcm`), checked and typed.

Every problem is a ConfigError naming the key, found when the backend is made: before any file
is written, in dry runs too. A section without a key has what the shipped file would give it
(status, logs and cancel make the backend with no section at all).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher_scripts.clusters.base import signal_grace_seconds
from launcher_scripts.config.checks import require_int
from launcher_scripts.errors import ConfigError

# sbatch options the cluster section may pass through by long name (without "--"). Options
# the backend sets itself (nodes, tasks, time, output, array, dependency, ...) are not here.
PASSTHROUGH_OPTIONS = frozenset(
    {
        "begin",
        "constraint",
        "contiguous",
        "core-spec",
        "cores-per-socket",
        "cpu-freq",
        "cpus-per-gpu",
        "deadline",
        "distribution",
        "gpu-bind",
        "gpu-freq",
        "gres",
        "gres-flags",
        "hint",
        "licenses",
        "mail-type",
        "mail-user",
        "mem-bind",
        "mem-per-cpu",
        "mem-per-gpu",
        "network",
        "nice",
        "no-kill",
        "power",
        "priority",
        "profile",
        "propagate",
        "sockets-per-node",
        "spread-job",
        "switches",
        "threads-per-core",
        "tmp",
        "uid",
        "wckey",
    }
)


@dataclass(frozen=True)
class SlurmSettings:
    # Cluster keys that are sbatch options of the same name; None: not set (left out).
    partition: str | None
    account: str | None
    qos: str | None
    reservation: str | None
    comment: str | None
    nodelist: str | None
    # The partition of a job's companions (PPO's servers); None: the job's.
    companion_partition: str | None
    exclude: str  # cluster.exclude as sbatch takes it ("" for none)
    job_name_prefix: str
    # Where cluster validation's verdicts are when cluster.exclude_unhealthy is set, else None.
    validation_results: Path | None
    # cluster.gpus_per_node is set: a GPU job's script asks for its GPUs per node (null leaves
    # GPU GRES out, for clusters without it).
    gpus_per_node_option: bool
    gpus_per_node: int | None
    gpus_per_task: str | None
    mem: str | None
    exclusive: bool  # a job that asks for whole nodes gets --exclusive
    overcommit: bool
    srun_args: tuple[str, ...]
    signal_grace_seconds: int
    max_restarts: int
    # cluster.sbatch_options by name, each (option, value); None: a flag without a value.
    sbatch_options: tuple[tuple[str, str | None], ...]

    def direct_options(self) -> list[tuple[str, str]]:
        """The set options among those the cluster section names after sbatch's, in the
        order the script lists them."""
        options = (
            ("partition", self.partition),
            ("account", self.account),
            ("qos", self.qos),
            ("reservation", self.reservation),
            ("comment", self.comment),
            ("nodelist", self.nodelist),
        )
        return [(name, value) for name, value in options if value is not None]


def slurm_settings(cluster: Mapping[str, Any] | None) -> SlurmSettings:
    """The checked settings of a resolved `cluster` section (None or {}: the defaults)."""
    cluster = cluster or {}
    options = cluster.get("sbatch_options") or {}
    for name in options:
        if str(name) not in PASSTHROUGH_OPTIONS:
            raise ConfigError(
                f"cluster.sbatch_options.{name}",
                "is not an sbatch option this launcher passes through",
                f"Use one of: {', '.join(sorted(PASSTHROUGH_OPTIONS))} "
                "(or the cluster key of the same meaning, e.g. cluster.partition)",
            )
    grace = signal_grace_seconds(cluster)
    restarts = cluster.get("max_restarts", 0)
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise ConfigError("cluster.max_restarts", f"{restarts!r} is not an integer >= 0", "Fix it")
    # Read only when asked for: its default interpolates base_results_dir.
    unhealthy = cluster.get("exclude_unhealthy")
    return SlurmSettings(
        partition=_set_text(cluster.get("partition")),
        account=_set_text(cluster.get("account")),
        qos=_set_text(cluster.get("qos")),
        reservation=_set_text(cluster.get("reservation")),
        comment=_set_text(cluster.get("comment")),
        nodelist=_set_text(cluster.get("nodelist")),
        companion_partition=_set_text(cluster.get("companion_partition")),
        exclude=str(cluster.get("exclude") or ""),
        job_name_prefix=str(cluster.get("job_name_prefix") or ""),
        validation_results=Path(str(cluster.get("validation_results"))) if unhealthy else None,
        gpus_per_node_option=cluster.get("gpus_per_node") is not None,
        gpus_per_node=None
        if cluster.get("gpus_per_node") is None
        else require_int("cluster.gpus_per_node", cluster.get("gpus_per_node")),
        gpus_per_task=_given_text(cluster.get("gpus_per_task")),
        mem=_given_text(cluster.get("mem")),
        exclusive=bool(cluster.get("exclusive", True)),
        overcommit=bool(cluster.get("overcommit")),
        srun_args=tuple(str(arg) for arg in cluster.get("srun_args") or ()),
        signal_grace_seconds=grace,
        max_restarts=restarts,
        sbatch_options=tuple(
            (str(name), None if value is True else str(value))
            for name, value in sorted(options.items(), key=lambda item: str(item[0]))
        ),
    )


def _set_text(value: Any) -> str | None:
    """A value the script takes only when it is set (null, "" and 0 leave it out)."""
    return str(value) if value else None


def _given_text(value: Any) -> str | None:
    """A value the script takes whenever it is not null (0 included: `mem: 0` is all)."""
    return None if value is None else str(value)
