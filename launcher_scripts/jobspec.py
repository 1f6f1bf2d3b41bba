"""What a stage asks a cluster to run, independent of any cluster.

Stages build JobSpecs from the resolved configuration; backends render them to scripts.
Commands are argv tuples, never shell strings: backends quote them when they render.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# How a job waits for the one before it: `afterok` (it succeeded), `afterany` (it ended),
# `singleton` (also after every earlier job of the same name), or `aftercorr` (array task i
# after task i of the array before it; stages set it, not users).
USER_DEPENDENCIES = ("afterok", "afterany", "singleton")


@dataclass(frozen=True)
class Command:
    """One program run: `python -m module args...`, on `nproc_per_node` processes per node."""

    module: str
    args: tuple[str, ...] = ()
    nproc_per_node: int = 1  # > 1 starts a distributed launcher (torchrun, srun tasks)


@dataclass(frozen=True)
class Resources:
    nodes: int = 1
    ntasks_per_node: int = 1
    gpus_per_node: int = 0  # 0: a CPU-only job, which asks for no GPUs
    cpus_per_task: int | None = None
    time_limit: str = "01:00:00"
    exclusive: bool = False
    # The key that sets gpus_per_node, for the line refusing more than a node has ("": the
    # stage's trainer.devices).
    gpus_key: str = ""


# Where a companion finds the node of its job's main program, when a scheduler placed them
# apart (Slurm's heterogeneous job): a host name, in its environment.
MAIN_HOST_VARIABLE = "LAUNCHER_MAIN_HOST"


@dataclass(frozen=True)
class Companion:
    """A program started with a job and ended with it, on resources of its own (PPO's servers
    beside the actor): the job's end ends it; its end first ends the job, as a failure naming
    it. Slurm runs a job with companions as one heterogeneous job; local, as processes of one
    script."""

    name: str  # what messages and its log call it: "reward_model"
    command: Command
    resources: Resources
    key: str = ""  # the recipe key that asks for it, for messages


@dataclass(frozen=True)
class JobSpec:
    """One job of a stage. A stage may have several, run one after the other."""

    stage: str  # the config group, e.g. "data_preparation"
    name: str  # unique within a run; names the script and the logs
    results_dir: str
    commands: tuple[Command, ...]
    resources: Resources = field(default_factory=Resources)
    env: tuple[tuple[str, str], ...] = ()  # sorted (name, value) pairs, never secrets
    pythonpath: str = ""  # where the job programs' package lives
    container: str | None = None
    container_mounts: tuple[str, ...] = ()
    array_size: int | None = None  # tasks of a node array; each task takes its share by rank
    dependency: str = "afterok"  # see USER_DEPENDENCIES; stages may set "aftercorr"
    reads: tuple[str, ...] = ()  # paths of artifacts the job needs
    writes: tuple[str, ...] = ()  # paths of artifacts the job produces
    # A job that saves a checkpoint and exits with this code when signalled, so a scheduler may
    # requeue it; progress_dir holds its checkpoints (to tell whether an attempt advanced).
    checkpoint_exit_code: int | None = None
    progress_dir: str | None = None
    companions: tuple[Companion, ...] = ()  # started with the job's last command, ended with it
