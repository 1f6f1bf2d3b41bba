"""The launcher's `serve EXPORT_DIR [--slurm | --render] [overrides]` command: the Triton
server of an export started here (the server program, launcher_scripts.jobs.export.serve),
submitted as a Slurm job that runs that program, or rendered for the cluster type the
overrides name (a Slurm or BCP script, a Kubernetes manifest) for the user to start.

The job is rendered like every stage's: the cluster section, `container` and `container_mounts`
of the composed config apply (a Triton container puts `tritonserver` on PATH, which `serve`
takes first). Inside it, `serve` picks free ports and writes where it listens to
EXPORT_DIR/endpoint.json once the server is ready.

A command, above the job programs: it imports the server program to run it here, and the
stages and the Slurm backend (only when submitting: serving here needs none of them) to
submit it. The server program imports nothing of this module.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from launcher_scripts.config.checks import require_int
from launcher_scripts.errors import ConfigError, LauncherError
from launcher_scripts.files import write_atomic
from launcher_scripts.jobs.export import serve
from launcher_scripts.jobspec import Command, JobSpec, Resources

SERVE = "launcher_scripts.jobs.export.serve"
ENDPOINT_FILE = "endpoint.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=serve.PROG, description=serve.DESCRIPTION, parents=[serve.server_options()]
    )
    parser.add_argument(
        "--slurm",
        action="store_true",
        help="submit the server as a Slurm job instead (overrides: cluster.*, container, "
        "export.serving.*)",
    )
    parser.add_argument(
        "--render",
        action="store_true",
        help="write the server's job for cluster_type=bcm|bcp|k8s (an override; bcm by "
        "default) beside the export, without submitting it",
    )
    parser.add_argument(
        "overrides", nargs="*", help="with --slurm or --render: launcher config overrides"
    )
    args = parser.parse_intermixed_args(argv)  # overrides may follow --slurm
    if args.slurm and args.render:
        parser.error("--slurm submits, --render only writes the job: give one of them")
    if args.overrides and not (args.slurm or args.render):
        parser.error("config overrides apply to --slurm and --render only")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.slurm:
        return submit_server(args.export_dir.resolve(), args.overrides)
    if args.render:
        return render_server(args.export_dir.resolve(), args.overrides)
    return serve.run(args)


RENDERED = {"bcm": "serve_submission.sh", "bcp": "serve_bcp.sh", "k8s": "serve_manifest.yaml"}
HOW_TO_START = {
    "bcm": "sbatch {path}",
    "bcp": "bash {path} on node 0 of a Base Command Platform job",
    "k8s": "kubectl apply -f {path}",
}


def rendered_server(export_dir: Path, overrides: list[str]) -> tuple[str, str]:
    """(cluster type, the serving job rendered by its backend)."""
    from launcher_scripts.clusters import BACKENDS
    from launcher_scripts.config.compose import compose_config

    given = any(o.lstrip("+").startswith("cluster_type=") for o in overrides)
    root = compose_config(overrides if given else ["cluster_type=bcm", *overrides])
    kind = str(root.cluster_type)
    if kind not in RENDERED:
        raise ConfigError(
            "cluster_type",
            f"is {kind}: a server for this machine starts without a job",
            "Drop --render (and the overrides) to serve here, or give cluster_type=bcm, bcp or k8s",
        )
    return kind, BACKENDS[kind](root).render(serve_job(root, export_dir))


def render_server(export_dir: Path, overrides: list[str]) -> int:
    """`serve EXPORT_DIR --render overrides...`: the job written beside the export."""
    try:
        kind, text = rendered_server(export_dir, overrides)
    except (ConfigError, LauncherError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    path = export_dir / RENDERED[kind]
    write_atomic(path, text)
    print(
        f"wrote {path}; start it with {HOW_TO_START[kind].format(path=path)}. Once Triton is "
        f"ready, {export_dir / ENDPOINT_FILE} holds its host and ports.",
        flush=True,
    )
    return 0


def serve_job(root: Any, export_dir: Path) -> JobSpec:
    from launcher_scripts.stages.base import StageContext, make_job

    serving = root.export.serving
    gpus = require_int("export.serving.gpus_per_node", serving.gpus_per_node, minimum=0)
    try:
        served = serve.served_model(serve.model_repository(export_dir))
    except serve.ServeError as error:
        raise ConfigError("export_dir", str(error), "Export first (stages=[export])") from None
    nodes = require_int("export.serving.nodes", serving.get("nodes", 1), minimum=1)
    ranks = served.tensor * served.pipeline
    layout = f"the export serves at TP={served.tensor} x PP={served.pipeline}: {ranks} model "
    if ranks % nodes:
        raise ConfigError(
            "export.serving.nodes",
            f"is {nodes}, but {layout}processes, which {nodes} nodes cannot share evenly",
            f"Set it to a divisor of {ranks}",
        )
    per_node = ranks // nodes
    if 0 < gpus < per_node:
        raise ConfigError(
            "export.serving.gpus_per_node",
            f"is {gpus}, but {layout}processes, {per_node} on each of {nodes} node(s), one GPU "
            "each",
            f"Set it to {per_node}, or export.serving.nodes to {-(-ranks // gpus)} (or "
            "gpus_per_node to 0 for a CPU server)",
        )
    args = (str(export_dir), "--http-port=auto", "--grpc-port=auto")
    args += (f"--endpoint-file={export_dir / ENDPOINT_FILE}",)
    # On one node, `serve` runs the model's ranks under torchrun; across nodes, the step's
    # tasks are the ranks (task 0 also serves: jobs/export/serve.py).
    tasks = per_node if nodes > 1 else 1
    return make_job(
        StageContext(root, "export"),
        "serve",
        (Command(SERVE, args, nproc_per_node=tasks),),
        Resources(
            nodes=nodes,
            ntasks_per_node=tasks,
            gpus_per_node=gpus,
            time_limit=str(serving.time_limit),
            gpus_key="export.serving.gpus_per_node",
        ),
        results_dir=str(export_dir),
        reads=(str(export_dir),),
    )


def submit(export_dir: Path, overrides: list[str]) -> str:
    """Render and submit the serving job; returns the Slurm job id."""
    from launcher_scripts.clusters.base import JobRecord
    from launcher_scripts.clusters.slurm import SlurmBackend
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


def submit_server(export_dir: Path, overrides: list[str]) -> int:
    """`serve EXPORT_DIR --slurm`: submit, and say where the server will say it listens."""
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
