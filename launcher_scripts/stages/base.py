"""The stage interface and registry: a stage turns its resolved config into JobSpecs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from omegaconf import DictConfig, OmegaConf

from launcher_scripts.config.checks import require_choice, require_env_name
from launcher_scripts.config.schema import Declared
from launcher_scripts.errors import ConfigError
from launcher_scripts.formats import nccl_topology
from launcher_scripts.jobspec import USER_DEPENDENCIES, Command, Companion, JobSpec, Resources
from launcher_scripts.recipes.numa import NumaPolicy

NUMA_BINDING = "launcher_scripts.jobs.numa_binding"


@dataclass(frozen=True)
class StageContext:
    """What a stage sees: the whole resolved config and its own section of it."""

    root: DictConfig
    stage: str
    upstream_writes: frozenset[str] = field(default_factory=frozenset)
    # Inputs a dry run found missing: it goes on (so a run can be planned before its data
    # exists) and lists them; a real run stops at the first one.
    missing_inputs: list[str] = field(default_factory=list)
    # Whether the jobs' processes will find a CUDA GPU (None: not known here), asked of the
    # backend only by a check that needs it (Backend.jobs_find_gpus).
    jobs_find_gpus: Callable[[], bool | None] = lambda: None

    @property
    def cfg(self) -> DictConfig:
        return self.root[self.stage]

    @property
    def config_path(self) -> Path:
        """Where the pipeline writes this stage's resolved config, which jobs may read."""
        run = self.cfg.run
        return Path(str(run.results_dir)) / f"{run.name}_hydra.yaml"

    def will_exist(self, path: str | Path) -> bool:
        """Whether an earlier stage of this run writes `path` (or a folder holding it). In a
        dry run, also any other path, which is then noted in `missing_inputs`."""
        target = Path(str(path))
        if self.written_upstream(target):
            return True
        if self.root.get("dry_run"):
            self.missing_inputs.append(str(target))
            return True
        return False

    def left_for_the_run(self, path: str | Path) -> bool:
        """Whether a check of `path` is left to the run: an earlier stage writes it, or a dry
        run does not find it (noted in missing_inputs: a cluster's filesystem, a BCP
        workspace, may hold what this machine lacks)."""
        target = Path(str(path))
        return self.written_upstream(target) or (not target.exists() and self.will_exist(target))

    def written_upstream(self, path: str | Path) -> bool:
        """Whether an earlier stage of this run writes `path` (or a folder holding it)."""
        target = Path(str(path))
        return any(
            target == Path(written) or Path(written) in target.parents
            for written in self.upstream_writes
        )

    def not_written(self, path: str | Path) -> str:
        """The problem of an input that neither exists nor is written by an earlier stage, with
        what the run does write of its kind (a .nemo file, say): most often the file that a
        recipe of another model (gpt3_126m against gpt3_tiny) expected under another name."""
        suffix = Path(str(path)).suffix
        like = sorted(w for w in self.upstream_writes if suffix and Path(w).suffix == suffix)
        shown = f" (this run writes {', '.join(like[:2])})" if like else ""
        return f"{path} does not exist and no earlier stage of this run writes it{shown}"

    def require_input(self, name: str, fix: str) -> Path:
        """`<stage>.model.<name>` names a path that exists, or that an earlier stage of this
        run writes; otherwise ConfigError with `fix`."""
        path = Path(str(self.cfg.model[name]))
        if not path.exists() and not self.will_exist(path):
            raise ConfigError(f"{self.stage}.model.{name}", self.not_written(path), fix)
        return path

    def common_env(self) -> tuple[tuple[str, str], ...]:
        """`env_vars` without null values, plus where jobs find the W&B key file."""
        env: dict[str, Any] = OmegaConf.to_container(self.root.env_vars, resolve=True) or {}
        pairs = {
            require_env_name(f"env_vars.{name}", name): str(value)
            for name, value in env.items()
            if value is not None
        }
        if self.root.get("wandb_api_key_file"):
            pairs["WANDB_API_KEY_FILE"] = str(self.root.wandb_api_key_file)
        topology = nccl_topology.exported_path(self.root)
        if topology is not None:
            pairs["NCCL_TOPO_FILE"] = topology
        return tuple(sorted(pairs.items()))


def require_job_program(ctx: StageContext, name: str, value: str, runnable: bool) -> None:
    """A recipe whose job program this launcher version lacks still composes, validates and
    renders in a dry run; a real run stops here, before anything is written or submitted."""
    if runnable or ctx.root.get("dry_run"):
        return
    raise ConfigError(
        f"{ctx.stage}.{name}",
        f"{value}: this launcher version has the recipe but no job program for it yet",
        "Use dry_run=true to check and render it, or a recipe this version runs",
    )


class Stage(Protocol):
    name: str
    # The optional and free-form keys the stage's programs read beyond its shipped recipes'
    # (the preflight's key check knows them from here).
    declared_keys: tuple[Declared, ...]

    def validate(self, ctx: StageContext) -> None:
        """Raise ConfigError for anything that would make the jobs fail; no side effects."""

    def jobs(self, ctx: StageContext) -> list[JobSpec]:
        """The jobs to run, in order. Pure: no network, no file writes."""

    def plan(self, ctx: StageContext) -> list[str]:
        """What the dry run prints about the stage beyond its jobs (a training run's cost)."""


class StageDefaults:
    """What most stages answer to Stage's questions that not every stage needs: every stage
    derives from it and overrides what it has."""

    declared_keys: tuple[Declared, ...] = ()

    def plan(self, ctx: StageContext) -> list[str]:
        return []


STAGES: dict[str, Stage] = {}


def register(stage_class: Callable[[], Stage]) -> Callable[[], Stage]:
    instance = stage_class()
    STAGES[instance.name] = instance
    return stage_class


def make_job(
    ctx: StageContext,
    name: str,
    commands: tuple[Command, ...],
    resources: Resources,
    *,
    array_size: int | None = None,
    reads: tuple[str, ...] = (),
    writes: tuple[str, ...] = (),
    checkpoint_exit_code: int | None = None,
    progress_dir: str | None = None,
    task_to_task: bool = False,
    results_dir: str | None = None,
    companions: tuple[Companion, ...] = (),
) -> JobSpec:
    """A JobSpec with the settings every job of every stage shares, taken from the root config.

    Stages say what differs (commands, resources, artifacts); this is the one place that knows
    where the code, the container, the mounts and the environment come from.

    `task_to_task`: an array job whose task i needs only task i of the array job before it,
    so each task may start as soon as its own predecessor ends (Slurm's aftercorr).
    """
    root, run = ctx.root, ctx.cfg.run
    dependency = str(run.get("dependency") or "afterok")
    require_choice(f"{ctx.stage}.run.dependency", dependency, USER_DEPENDENCIES)
    return JobSpec(
        stage=ctx.stage,
        name=require_job_name(f"{ctx.stage}.run.name", name),
        results_dir=results_dir or str(run.results_dir),
        commands=tuple(numa_bound(root, command, resources) for command in commands),
        resources=resources,
        env=ctx.common_env(),
        pythonpath=str(root.launcher_scripts_path),
        container=root.container,
        container_mounts=tuple(str(m) for m in root.container_mounts or ()),
        array_size=array_size,
        dependency="aftercorr" if task_to_task else dependency,
        reads=reads,
        writes=writes,
        checkpoint_exit_code=checkpoint_exit_code,
        progress_dir=progress_dir,
        companions=tuple(
            replace(c, command=numa_bound(root, c.command, c.resources)) for c in companions
        ),
    )


def require_job_name(key: str, name: str) -> str:
    """A job's name becomes file names (its script, its logs), a scheduler's job name and a
    comment line of its script: no '/', no newline or other control character."""
    if not name or "/" in name or any(ord(char) < 32 or ord(char) == 127 for char in name):
        raise ConfigError(
            key,
            f"{name!r} cannot name a job (it names its script, its log files and the "
            "scheduler's job): it is empty or holds a '/' or a control character such as a "
            "newline",
            "Use letters, digits, '_', '-' and '.'",
        )
    return name


def numa_bound(root: Any, command: Command, resources: Resources) -> Command:
    """`command` started through the NUMA binding wrapper when numa_mapping.enable is set and
    the job runs one process per GPU (CPU jobs, and GPU jobs whose one process drives several
    GPUs, are left as they are)."""
    numa = root.get("numa_mapping")
    if not numa or not numa.get("enable"):
        return command
    if not resources.gpus_per_node or command.nproc_per_node != resources.gpus_per_node:
        return command
    policy = NumaPolicy(
        mode=str(numa.mode),
        scope=str(numa.scope),
        cores=str(numa.cores),
        balanced=bool(numa.balanced),
        min_cores=int(numa.min_cores),
        max_cores=None if numa.max_cores is None else int(numa.max_cores),
    )
    args = (*policy.args(command.nproc_per_node), "--", command.module, *command.args)
    return Command(NUMA_BINDING, args, command.nproc_per_node)
