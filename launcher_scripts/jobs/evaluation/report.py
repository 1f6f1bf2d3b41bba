"""What an evaluation leaves: lm-eval's results as JSON, a markdown table, per-sample logs.

Every file is written under a temporary name and renamed, so a reader (or a rerun after a
failure) never sees half a file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from launcher_scripts.files import write_atomic

STDERR = "_stderr"


def write(results_dir: Path, results: dict[str, Any]) -> list[Path]:
    """results.json (without the samples), results.md and samples_<task>.jsonl; their paths."""
    results_dir.mkdir(parents=True, exist_ok=True)
    samples = results.get("samples") or {}
    summary = {key: value for key, value in results.items() if key != "samples"}
    files = {
        results_dir / "results.json": to_json(summary, indent=2),
        results_dir / "results.md": markdown(results),
    }
    for task, rows in samples.items():
        files[results_dir / f"samples_{task}.jsonl"] = "".join(to_json(row) + "\n" for row in rows)
    for path, text in files.items():
        write_atomic(path, text)
    return list(files)


def metric_rows(results: dict[str, Any]) -> list[tuple[str, str, Any, Any]]:
    """(task, metric, value, stderr) for every metric of every task and group, in lm-eval's
    order. Metric keys are lm-eval's "name,filter"; the filter is shown when it is not "none"."""
    rows = []
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if "," not in key or STDERR in key:
                continue
            name, _, filter_name = key.partition(",")
            label = name if filter_name == "none" else f"{name} ({filter_name})"
            stderr = metrics.get(f"{name}{STDERR},{filter_name}")
            rows.append((task, label, value, stderr))
    return rows


def markdown(results: dict[str, Any]) -> str:
    lines = ["| task | metric | value | stderr |", "| --- | --- | ---: | ---: |"]
    for task, metric, value, stderr in metric_rows(results):
        lines.append(f"| {task} | {metric} | {_number(value)} | {_number(stderr)} |")
    return "\n".join(lines) + "\n"


def _number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "" if value in (None, "N/A") else str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.4f}"


def to_json(value: Any, indent: int | None = None) -> str:
    """Strict JSON: NaN and infinities (a stderr of one sample, say) are written as null."""
    return json.dumps(_finite(json.loads(json.dumps(value, default=_plain))), indent=indent)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def _plain(value: Any) -> Any:
    """JSON for what lm-eval leaves in its results: numpy scalars and arrays, sets, callables
    of task configs, and anything else as its text."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, set | tuple):
        return list(value)
    return str(value)
