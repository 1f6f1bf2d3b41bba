"""What an output of data preparation was made from, recorded beside it, so that a re-run redoes
an output whose inputs, tokenizer or settings changed and skips one that is still current.

The record of an output `X` (a file, or a dataset prefix) is `X.meta.json`, a JSON object whose
"fingerprint" is:

    {"settings": {...},                       what changes the output: a vocab size, a flag
     "tokenizer": {"<role>": "<sha256>"},     content hashes of the tokenizer files used
     "tokenizer_files": {"<role>": "<path>"}, where they were (for messages only: a moved
                                              tokenizer is the same tokenizer)
     "inputs": {"<path>": {"size", "mtime_ns"}}}  each input as it was (a folder: a summary)

A record is written before the file that marks the output complete (a .model, an .idx, the
output file itself), and that marker is removed first when an output is redone, so a present
marker always has the record of its own run beside it.

What is gone cannot be compared: an input or tokenizer file that no longer exists (removed by
--remove-inputs, say) is not a reason to redo. An output without a record (written by another
tool, or by a version without records) is redone when its inputs are there to redo it from.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

RECORD_SUFFIX = ".meta.json"

Fingerprint = dict[str, Any]


def record_path(output: str | Path) -> Path:
    output = Path(output)
    return output.with_name(output.name + RECORD_SUFFIX)


def read_record(output: str | Path) -> dict[str, Any] | None:
    """The record beside `output`; None when it is missing or unreadable."""
    try:
        record = json.loads(record_path(output).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write_record(output: str | Path, record: Mapping[str, Any]) -> None:
    """Write the record whole (a temporary name, then a rename)."""
    path = record_path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def remove_record(output: str | Path) -> None:
    record_path(output).unlink(missing_ok=True)


def file_hash(path: str | Path) -> str | None:
    """sha256 of a file's bytes; None when it does not exist. Remembered while the file keeps
    its size and mtime: a job compares one tokenizer with thousands of outputs."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return _file_hash(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _file_hash(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def input_state(path: str | Path) -> dict[str, Any] | None:
    """An input as it is now: size and mtime of a file; of a folder, its file count, total
    size, newest mtime and a hash of the file names. None when it does not exist."""
    path = Path(path)
    try:
        if not path.is_dir():
            stat = path.stat()
            return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        names, size, newest = hashlib.sha256(), 0, 0
        count = 0
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            stat = file.stat()
            names.update(str(file.relative_to(path)).encode("utf-8", "surrogateescape") + b"\0")
            size += stat.st_size
            newest = max(newest, stat.st_mtime_ns)
            count += 1
        return {"files": count, "size": size, "mtime_ns": newest, "names": names.hexdigest()}
    except FileNotFoundError:
        return None


def make(
    settings: Mapping[str, Any],
    inputs: Sequence[str | Path] = (),
    tokenizer: Mapping[str, str | Path | None] | None = None,
) -> Fingerprint:
    """The fingerprint of an output made now from `inputs` with `tokenizer` (role -> file)."""
    files = {role: path for role, path in (tokenizer or {}).items() if path is not None}
    made: Fingerprint = {
        "settings": dict(settings),
        "tokenizer": {role: file_hash(path) for role, path in files.items()},
        "inputs": {str(path): input_state(path) for path in inputs},
    }
    if files:
        made["tokenizer_files"] = {role: str(path) for role, path in files.items()}
    return made


def stale_reasons(recorded: Fingerprint | None, current: Fingerprint) -> list[str]:
    """Why an output recorded with `recorded` must be redone to match `current`; empty when
    it is current."""
    inputs_now = current.get("inputs", {})
    if recorded is None:
        if any(state is not None for state in inputs_now.values()) or not inputs_now:
            return ["no fingerprint recorded"]
        return []  # nothing left to redo it from
    reasons = []
    settings_then, settings_now = recorded.get("settings", {}), current.get("settings", {})
    changed = sorted(k for k in settings_then.keys() | settings_now.keys()
                     if settings_then.get(k) != settings_now.get(k))  # fmt: skip
    if changed:
        reasons.append(
            "settings changed ("
            + ", ".join(f"{k} {settings_then.get(k)!r} -> {settings_now.get(k)!r}" for k in changed)
            + ")"
        )
    tokenizer_then, tokenizer_now = recorded.get("tokenizer", {}), current.get("tokenizer", {})
    if any(
        digest is not None and tokenizer_then.get(role) != digest
        for role, digest in tokenizer_now.items()
    ) or set(tokenizer_then) != set(tokenizer_now):
        reasons.append("tokenizer changed")
    inputs_then = recorded.get("inputs", {})
    if set(inputs_then) != set(inputs_now):
        reasons.append("input files changed")
    else:
        reasons += [
            f"input {path} changed"
            for path, state in inputs_now.items()
            if state is not None and inputs_then.get(path) != state
        ]
    return reasons


def recorded_fingerprint(output: str | Path) -> Fingerprint | None:
    record = read_record(output)
    fingerprint = record.get("fingerprint") if record else None
    return fingerprint if isinstance(fingerprint, dict) else None
