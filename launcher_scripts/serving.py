"""`serve EXPORT_DIR --slurm [overrides]`: the Triton server of an export as a Slurm job.

The job is rendered like every stage's: the cluster section, `container` and `container_mounts`
of the composed config apply (a Triton container puts `tritonserver` on PATH, which `serve`
takes first). Inside it, `serve` picks free ports and writes where it listens to
EXPORT_DIR/endpoint.json once the server is ready.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launcher_scripts.clusters.base import JobRecord
from launcher_scripts.clusters.slurm import SlurmBackend
from launcher_scripts.config.checks import require_int
from launcher_scripts.errors import ConfigError, LauncherError
from launcher_scripts.jobspec import Command, JobSpec, Resources
from launcher_scripts.stages.base import StageContext, make_job

SERVE = "launcher_scripts.jobs.export.serve"
ENDPOINT_FILE = "endpoint.json"


def serve_job(root: Any, export_dir: Path) -> JobSpec:
    serving = root.export.serving
    gpus = require_int("export.serving.gpus_per_node", serving.gpus_per_node, minimum=0)
    args = (str(export_dir), "--http-port=auto", "--grpc-port=auto")
    args += (f"--endpoint-file={export_dir / ENDPOINT_FILE}",)
    return make_job(
        StageContext(root, "export"),
        "serve",
        (Command(SERVE, args),),
        Resources(gpus_per_node=gpus, time_limit=str(serving.time_limit)),
        results_dir=str(export_dir),
        reads=(str(export_dir),),
    )


def submit(export_dir: Path, overrides: list[str]) -> str:
    """Render and submit the serving job; returns the Slurm job id."""
    from launcher_scripts.config.compose import compose_config

    root = compose_config(["cluster_type=bcm", *overrides])
    job = serve_job(root, export_dir)
    backend = SlurmBackend(root)
    backend.check_submission([job])
    script = export_dir / "serve_submission.sh"
    script.write_text(backend.render(job))
    (export_dir / ENDPOINT_FILE).unlink(missing_ok=True)
    record = JobRecord(
        name=job.name, stage="export", backend=backend.name, script=str(script), log=""
    )
    backend.submit(str(script), job, record, after=(), on_start=lambda _record: None)
    return record.job_ids[0]


def main(export_dir: Path, overrides: list[str]) -> int:
    import sys

    try:
        job_id = submit(export_dir, overrides)
    except (ConfigError, LauncherError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(
        f"submitted the Triton server as Slurm job {job_id} (script "
        f"{export_dir / 'serve_submission.sh'}). Once it is ready, {export_dir / ENDPOINT_FILE} "
        f"holds its host and ports; `scancel {job_id}` stops it.",
        flush=True,
    )
    return 0
