"""From a composed configuration to jobs: check, plan, write, submit in order, record.

Planning is pure (validate, build JobSpecs, render); writing and submitting come after it, so
a bad configuration is reported before any file is written or any job started.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from launcher_scripts.clusters import BACKENDS, Backend, JobRecord
from launcher_scripts.clusters.base import utc_now
from launcher_scripts.config import fixed_keys, schema
from launcher_scripts.config.compose import UnknownOverride, compose_config, config_groups
from launcher_scripts.config.preflight import check_globals, check_wandb, requested_stages, resolve
from launcher_scripts.errors import ConfigError, LauncherError
from launcher_scripts.files import write_atomic
from launcher_scripts.formats import nccl_topology
from launcher_scripts.jobspec import JobSpec
from launcher_scripts.manifest import Manifest, StageRecord, new_run_id
from launcher_scripts.recipes import numa
from launcher_scripts.stages import STAGES, StageContext


@dataclass(frozen=True)
class PlannedJob:
    spec: JobSpec
    script_path: Path
    script: str


@dataclass(frozen=True)
class PlannedStage:
    stage: str
    results_dir: Path
    config_path: Path
    config_yaml: str
    jobs: tuple[PlannedJob, ...]
    missing_inputs: tuple[str, ...] = ()  # a dry run's inputs that do not exist yet


def declared_keys() -> dict[str, tuple[schema.Declared, ...]]:
    """The optional and free-form keys each stage's programs read (beyond its recipes')."""
    return {name: tuple(stage.declared_keys) for name, stage in STAGES.items()}


def compose(argv: list[str]) -> DictConfig:
    """compose_config, with a key Hydra cannot override (the recipe lacks it) explained: the
    key the user meant, or how to add a key the stage reads."""
    try:
        return compose_config(argv)
    except UnknownOverride as error:
        first = error
    # Compose without the overrides Hydra cannot apply, to know the recipes they were meant for.
    rest = [arg for arg in argv if arg != first.override]
    while True:
        try:
            cfg = compose_config(rest)
            break
        except UnknownOverride as error:
            rest = [arg for arg in rest if arg != error.override]
        except LauncherError:
            raise first from None
    value = first.override.partition("=")[2]
    raise schema.explain_unknown(cfg, first.key, value, declared_keys()) from None


def plan(cfg: DictConfig) -> tuple[Backend, DictConfig, list[PlannedStage]]:
    """Validate everything and render every script, touching nothing on disk."""
    stages = requested_stages(cfg, STAGES, config_groups())
    # Keys no program reads, first: a misspelt key may be why a value is missing.
    schema.check_known_keys(cfg, stages, declared_keys())
    resolved = resolve(cfg, stages)
    # Booleans that are not (Hydra reads dry_run=maybe as a string), before anything looks at
    # the values.
    schema.check_booleans(resolved, stages)
    # NeMo's keys for what is fixed here: only the values that say what runs.
    fixed_keys.check_fixed_keys(resolved, stages)
    # The cluster types are the backends' names.
    check_globals(resolved, BACKENDS)
    nccl_topology.check_choice(resolved)
    numa.check_section(resolved.numa_mapping)
    backend: Backend = BACKENDS[resolved.cluster_type](resolved)
    check_wandb(resolved, stages, backend.jobs_use_launcher_environment())
    planned, names = [], set()
    written: set[str] = set()  # artifacts earlier stages of this run produce
    previous: JobSpec | None = None
    for stage in stages:
        ctx = StageContext(
            resolved, stage, frozenset(written), jobs_find_gpus=backend.jobs_find_gpus
        )
        STAGES[stage].validate(ctx)
        results_dir = Path(str(ctx.cfg.run.results_dir))
        jobs = []
        for spec in STAGES[stage].jobs(ctx):
            if spec.name in names:
                raise ConfigError(
                    f"{stage}.run.name", f"two jobs would be named {spec.name}", "Rename one"
                )
            names.add(spec.name)
            if spec.dependency == "aftercorr" and (
                previous is None or previous.array_size != spec.array_size
            ):
                raise LauncherError(
                    f"job {spec.name} is chained task to task but the job before it is not an "
                    "array of the same size (a bug in its stage: please report it)"
                )
            previous = spec
            written.update(spec.writes)
            script_path = results_dir / f"{spec.name}{backend.script_suffix}"
            jobs.append(PlannedJob(spec, script_path, backend.render(spec)))
        planned.append(
            PlannedStage(
                stage,
                results_dir,
                ctx.config_path,
                OmegaConf.to_yaml(ctx.cfg),
                tuple(jobs),
                tuple(dict.fromkeys(ctx.missing_inputs)),
            )
        )
    # What this cluster cannot run, any stage's job (more nodes than it has): once, here.
    backend.check_jobs([job.spec for stage in planned for job in stage.jobs])
    return backend, resolved, planned


def write_files(planned: list[PlannedStage]) -> None:
    for stage in planned:
        write_atomic(stage.config_path, stage.config_yaml)
        for job in stage.jobs:
            write_atomic(job.script_path, job.script)
            job.script_path.chmod(0o755)


def print_plan(planned: list[PlannedStage], backend: Backend, resolved: DictConfig) -> None:
    for line in backend.plan_notes():
        print(line)
    for stage in planned:
        print(f"stage {stage.stage}: config {stage.config_path}")
        for line in STAGES[stage.stage].plan(StageContext(resolved, stage.stage)):
            print(line)
        for job in stage.jobs:
            array = f", array of {job.spec.array_size}" if job.spec.array_size else ""
            if job.spec.dependency == "aftercorr":
                array += ", task i after task i of the job before"
            print(f"  job {job.spec.name} ({backend.name}{array}): {job.script_path}")
        if stage.missing_inputs:
            print(
                "  not there yet (a real run stops unless they exist or an earlier stage of "
                "the run writes them):"
            )
            shown = 4
            for path in stage.missing_inputs[:shown]:
                print(f"    {path}")
            if len(stage.missing_inputs) > shown:
                print(f"    ... and {len(stage.missing_inputs) - shown} more")


def git_revision(path: str) -> str | None:
    try:
        result = subprocess.run(
            ["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() or None


def run(cfg: DictConfig, argv: list[str]) -> int:
    backend, resolved, planned = plan(cfg)
    specs = [job.spec for stage in planned for job in stage.jobs]
    if not resolved.dry_run:
        # The scheduler is reachable and can run these jobs: before anything is written.
        backend.check_submission(specs)
    # A backend that runs inside a job started from outside renders that start in a dry run.
    outer = backend.outer_launch(specs, argv) if resolved.dry_run else None
    write_files(planned)
    if resolved.dry_run:
        print_plan(planned, backend, resolved)
        if outer is not None:
            name, text = outer
            path = Path(str(resolved.base_results_dir)) / name
            write_atomic(path, text)
            path.chmod(0o755)
            print(f"start the {backend.name} job that runs this pipeline with: {path}")
        print("dry run: every script is rendered and checked; nothing was run or submitted.")
        return 0
    for line in backend.plan_notes():  # what the dry run says first about the cluster
        print(line)
    run_id = new_run_id()
    manifest = Manifest(
        run_id=run_id,
        path=Path(str(resolved.base_results_dir)) / "runs" / run_id / "manifest.json",
        created=utc_now(),
        command=[sys.argv[0], *argv],
        cluster_type=str(resolved.cluster_type),
        git_revision=git_revision(str(resolved.launcher_scripts_path)),
        launcher_pid=os.getpid(),
    )
    for stage in planned:
        records = [
            JobRecord(
                name=job.spec.name,
                stage=stage.stage,
                backend=backend.name,
                script=str(job.script_path),
                log=backend.log_path(job.spec, run_id),
            )
            for job in stage.jobs
        ]
        artifacts = sorted({path for job in stage.jobs for path in job.spec.writes})
        manifest.stages.append(
            StageRecord(
                stage.stage, str(stage.results_dir), str(stage.config_path), records, artifacts
            )
        )
    manifest.save()
    manifest.link_stage_dirs()
    print(f"run {run_id}: manifest {manifest.path}")
    return submit_all(backend, planned, manifest)


def submit_all(backend: Backend, planned: list[PlannedStage], manifest: Manifest) -> int:
    after: list[str] = []
    for stage, stage_record in zip(planned, manifest.stages, strict=True):
        for job, record in zip(stage.jobs, stage_record.jobs, strict=True):
            if backend.synchronous and manifest.cancel_marker.exists():
                # Cancelled while the job before ended: start nothing more.
                record.state = "CANCELLED"
                return _stopped(manifest, record)
            print(f"==> {stage.stage}: {job.spec.name} (log: {record.log})", flush=True)
            backend.submit(str(job.script_path), job.spec, record, after, lambda _: manifest.save())
            if manifest.cancel_marker.exists() and record.state != "COMPLETED":
                record.state = "CANCELLED"
            manifest.save()
            if backend.synchronous and record.state != "COMPLETED":
                return _stopped(manifest, record)
            after = record.job_ids
    if backend.synchronous:
        print(f"run {manifest.run_id}: all stages completed")
    else:
        folder = manifest.path.parent
        print(f"run {manifest.run_id}: all jobs submitted, each after the one before it.")
        print(f"Follow it with: python3 -m launcher_scripts status {folder}")
    return 0


def _stopped(manifest: Manifest, failed: JobRecord) -> int:
    for record in manifest.jobs():
        if record.state == "PENDING":
            record.state = "CANCELLED"
    manifest.save()
    verb = "was cancelled" if failed.state == "CANCELLED" else "failed"
    if failed.exit_code is None:
        how = f"{verb} before it started; the pipeline stopped"
    else:
        how = f"{verb} with exit code {failed.exit_code}; the pipeline stopped. Log: {failed.log}"
    print(f"error: stage {failed.stage}, job {failed.name} {how}", file=sys.stderr)
    return failed.exit_code or 1
