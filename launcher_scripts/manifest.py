"""The run manifest: one JSON file per run, the record `status`, `logs` and `cancel` read.

It lives at <base_results_dir>/runs/<run_id>/manifest.json; every stage's results folder gets a
`run_manifest.json` link to the newest run that used it, so either folder finds it.
"""

from __future__ import annotations

import json
import os
import secrets
import time
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
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
        jobs = [JobRecord.from_json(job) for job in data.pop("jobs", [])]
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
        """The manifest at `path`; a LauncherError naming the file when it cannot be read or is
        not a manifest (truncated, edited by hand), never a traceback."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as error:
            raise corrupt_manifest(path, f"cannot be read ({error.strerror})") from None
        except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
            raise corrupt_manifest(path, f"is not valid JSON ({error})") from None
        problem = _shape_problem(cls, data, "", skip=("path",))
        if problem:
            raise corrupt_manifest(path, problem)
        stages = [StageRecord.from_json(stage) for stage in data.pop("stages", [])]
        return cls(**data, path=path, stages=stages)


def corrupt_manifest(path: Path, problem: str) -> LauncherError:
    return LauncherError(
        f"{path}: this run manifest {problem}. It is the launcher's record of the run: restore "
        f"it if it was edited; otherwise read the job logs in the stages' results folders "
        f"directly (the next run writes a new manifest)"
    )


def _shape_problem(cls: type, data: object, where: str, skip: tuple[str, ...] = ()) -> str:
    """What is wrong with `data` as the JSON of dataclass `cls` (keys, types), or ""."""
    if not isinstance(data, dict):
        return f"has {_json_type(data)} where an object belongs{_at(where)}"
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls) if f.name not in skip}
    for key in data:
        if key not in known:
            return f"has an unknown key {where + key!r}"
    for name, spec in known.items():
        required = spec.default is MISSING and spec.default_factory is MISSING
        if name not in data:
            if required:
                return f"lacks the key {where + name!r}"
            continue
        problem = _value_problem(hints[name], data[name], where + name)
        if problem:
            return problem
    return ""


def _value_problem(hint: object, value: object, where: str) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        problems = [_value_problem(arg, value, where) for arg in args]
        return "" if "" in problems else problems[0]
    if origin is list:
        if not isinstance(value, list):
            return f"has {_json_type(value)} where a list belongs{_at(where)}"
        for index, item in enumerate(value):
            problem = _value_problem(args[0], item, f"{where}[{index}]")
            if problem:
                return problem
        return ""
    if origin is dict:
        if not isinstance(value, dict):
            return f"has {_json_type(value)} where an object belongs{_at(where)}"
        for key, item in value.items():
            problem = _value_problem(args[1], item, f"{where}.{key}")
            if problem:
                return problem
        return ""
    if hint is type(None):
        return "" if value is None else f"has {_json_type(value)} where null belongs{_at(where)}"
    if isinstance(hint, type) and hasattr(hint, "__dataclass_fields__"):
        return _shape_problem(hint, value, f"{where}.")
    # bool is an int to Python, not to this file.
    if isinstance(hint, type) and isinstance(value, hint) and not isinstance(value, bool):
        return ""
    return f"has {_json_type(value)} where {_json_name(hint)} belongs{_at(where)}"


def _at(where: str) -> str:
    return f" (at {where.rstrip('.')})" if where else ""


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    names.update({int: "a number", float: "a number", type(None): "null"})
    return f"{names.get(type(value), type(value).__name__)} {json.dumps(value)[:40]}"


def _json_name(hint: object) -> str:
    return {str: "a string", int: "an integer"}.get(hint, str(hint))  # type: ignore[call-overload]


def find_manifest(target: str | Path) -> Path:
    """The manifest for a path a user gives: the file, a run folder, a stage results folder,
    or a base results folder (its newest run)."""
    path = Path(target)
    candidates = [path, path / MANIFEST, path / STAGE_LINK]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
        if candidate.is_symlink():  # a link whose target is gone
            raise LauncherError(
                f"{candidate}: this link to the run manifest points to {os.readlink(candidate)}, "
                f"which does not exist (the run folder was moved or deleted). Give the run "
                f"folder, <base_results_dir>/runs/<run_id>, or launch the stage again"
            )
    runs = sorted((path / "runs").glob(f"*/{MANIFEST}")) if (path / "runs").is_dir() else []
    if runs:
        return runs[-1]
    raise LauncherError(
        f"{path}: no run manifest here. Give a stage results folder, a base_results_dir, "
        f"or <base_results_dir>/runs/<run_id>"
    )
