"""Run manifests written as a launcher would have written them."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_run_manifest(results: Path, *jobs: dict) -> Path:
    """A run manifest of one local data_preparation stage holding `jobs` (fields of
    launcher_scripts.clusters.JobRecord), as a launcher would have written it; returns it."""
    run_dir = results / "runs" / "r1"
    run_dir.mkdir(parents=True)
    defaults = {
        "stage": "data_preparation",
        "backend": "local",
        "script": "s.sh",
        "log": str(results / "log"),
        "state": "RUNNING",
        "exit_code": None,
        "start": "2026-01-01T00:00:00+00:00",
        "end": None,
    }
    manifest = {
        "run_id": "r1",
        "created": "r1",
        "command": ["main.py"],
        "cluster_type": "local",
        "git_revision": None,
        "launcher_pid": os.getpid(),
        "stages": [
            {
                "stage": "data_preparation",
                "results_dir": str(results),
                "config": "c.yaml",
                "jobs": [{**defaults, **job} for job in jobs],
                "artifacts": [],
            }
        ],
    }
    path = run_dir / "manifest.json"
    path.write_text(json.dumps(manifest))
    return path
