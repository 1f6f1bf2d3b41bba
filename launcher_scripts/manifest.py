"""The run manifest: one JSON file per run, the record `status`, `logs` and `cancel` read.

It lives at <base_results_dir>/runs/<run_id>/manifest.json; every stage's results folder gets a
`run_manifest.json` link to the newest run that used it, so either folder finds it.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from launcher_scripts.clusters.base import JobRecord
from launcher_scripts.errors import LauncherError
from launcher_scripts.files import write_atomic

MANIFEST = "manifest.json"
STAGE_LINK = "run_manifest.json"
CANCEL_MARKER = "cancel_requested"


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


@dataclass
class StageRecord:
    stage: str
    results_dir: str
    config: str  # the resolved stage config written for this run
    jobs: list[JobRecord] = field(default_factory=list)
    artifacts: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        data = dict(self.__dict__)
        data["jobs"] = [job.to_json() for job in self.jobs]
        return data

    @classmethod
    def from_json(cls, data: dict) -> StageRecord:
        jobs = [JobRecord.from_json(job) for job in data.pop("jobs")]
        return cls(**data, jobs=jobs)


@dataclass
class Manifest:
    run_id: str
    path: Path
    created: str
    command: list[str]
    cluster_type: str
    git_revision: str | None
    launcher_pid: int
    stages: list[StageRecord] = field(default_factory=list)

    def save(self) -> None:
        data = {k: v for k, v in self.__dict__.items() if k not in ("path", "stages")}
        data["stages"] = [stage.to_json() for stage in self.stages]
        write_atomic(self.path, json.dumps(data, indent=2) + "\n")

    def link_stage_dirs(self) -> None:
        for stage in self.stages:
            link = Path(stage.results_dir) / STAGE_LINK
            temporary = link.with_name(f".{STAGE_LINK}.{os.getpid()}.tmp")
            temporary.unlink(missing_ok=True)
            temporary.symlink_to(self.path.resolve())
            os.replace(temporary, link)

    @property
    def cancel_marker(self) -> Path:
        return self.path.parent / CANCEL_MARKER

    def jobs(self) -> list[JobRecord]:
        return [job for stage in self.stages for job in stage.jobs]

    @classmethod
    def load(cls, path: Path) -> Manifest:
        data = json.loads(path.read_text())
        stages = [StageRecord.from_json(stage) for stage in data.pop("stages")]
        return cls(**data, path=path, stages=stages)


def find_manifest(target: str | Path) -> Path:
    """The manifest for a path a user gives: the file, a run folder, a stage results folder,
    or a base results folder (its newest run)."""
    path = Path(target)
    candidates = [path, path / MANIFEST, path / STAGE_LINK]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    runs = sorted((path / "runs").glob(f"*/{MANIFEST}")) if (path / "runs").is_dir() else []
    if runs:
        return runs[-1]
    raise LauncherError(
        f"{path}: no run manifest here. Give a stage results folder, a base_results_dir, "
        f"or <base_results_dir>/runs/<run_id>"
    )
