"""What the data_preparation datasets share: keys, CPU resources, arrays, URL checks, jobs."""

from __future__ import annotations

from urllib.parse import urlparse

from launcher_scripts.config.checks import require_file, require_int
from launcher_scripts.errors import ConfigError
from launcher_scripts.jobspec import Command, JobSpec, Resources
from launcher_scripts.stages.base import StageContext, make_job

JOBS = "launcher_scripts.jobs.data_prep"


def stage_key(ctx: StageContext, name: str) -> str:
    return f"{ctx.stage}.{name}"


def cpu_resources(ctx: StageContext) -> Resources:
    """Data preparation needs CPUs, not GPUs: one node per array task, one task per node."""
    run = ctx.cfg.run
    return Resources(
        nodes=1,
        ntasks_per_node=1,
        cpus_per_task=run.get("cpus_per_node"),
        time_limit=str(run.time_limit),
    )


def workers_args(ctx: StageContext) -> tuple[str, ...]:
    workers = ctx.cfg.run.get("workers_per_node")
    if workers is None:
        return ()
    require_int(stage_key(ctx, "run.workers_per_node"), workers)
    return ("--workers", str(workers))


def array_size(ctx: StageContext, items: int) -> int:
    wanted = require_int(stage_key(ctx, "run.node_array_size"), ctx.cfg.run.node_array_size)
    return max(1, min(wanted, items))


def require_url(ctx: StageContext, name: str, *, allow_path: bool) -> None:
    """`<stage>.<name>` is an http(s) URL, or (allow_path) an existing local file."""
    value = str(ctx.cfg[name] or "")
    scheme = urlparse(value).scheme
    if scheme in ("http", "https"):
        return
    if allow_path and scheme in ("", "file"):
        require_file(stage_key(ctx, name), value.removeprefix("file://"))
        return
    raise ConfigError(stage_key(ctx, name), f"{value!r} is not an http(s) URL", "Fix the URL")


def program_job(
    ctx: StageContext,
    name: str,
    program: str,
    args: tuple[str, ...],
    array: int | None,
    writes: tuple[str, ...],
    chained: bool = False,
) -> JobSpec:
    """A CPU job running one data-preparation program; `chained`: task i after task i of the
    array job before it."""
    return make_job(
        ctx,
        name,
        (Command(f"{JOBS}.{program}", args),),
        cpu_resources(ctx),
        array_size=array,
        writes=writes,
        task_to_task=chained,
    )
