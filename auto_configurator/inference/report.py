"""What an inference search leaves in `<results_dir>/inference/final_summary/`.

inference_results.csv   every path, layout and batch size: latency per request, tokens/s, tokens/s
                        per GPU, or why it was not measured; the measured ones first, highest
                        tokens/s per GPU first
final_output.csv        the same table under the name NeMo's AutoConfigurator gives it
inference_results.png   tokens/s per GPU against latency, one series per path and layout, with the
                        latency budgets (benchmark.max_latency_ms) drawn in
summary.json            the highest tokens/s per GPU within each latency budget, and overall
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from auto_configurator.inference.runs import Point
from auto_configurator.inference.settings import InferenceSettings
from auto_configurator.report import pyplot
from launcher_scripts.files import write_atomic

COLUMNS = (
    "tp",
    "pp",
    "batch",
    "latency_s",
    "tokens_per_s",
    "tokens_per_s_per_gpu",
    "status",
    "path",
    "gpus",
    "input_len",
    "output_len",
    "generated_tokens",
    "rows_ended_early",
    "repeats",
    "log",
)


def ranked(points: Sequence[Point]) -> list[Point]:
    """Measured points by tokens/s per GPU (highest first), then the others as planned."""
    measured = sorted(
        (p for p in points if p.measured), key=lambda p: -(p.tokens_per_s_per_gpu or 0.0)
    )
    return measured + [p for p in points if not p.measured]


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.5g}"


def rows(points: Sequence[Point], settings: InferenceSettings) -> list[dict[str, str]]:
    return [
        {
            "tp": str(p.tensor),
            "pp": str(p.pipeline),
            "batch": str(p.batch),
            "latency_s": _fmt(p.latency_s),
            "tokens_per_s": _fmt(p.tokens_per_s),
            "tokens_per_s_per_gpu": _fmt(p.tokens_per_s_per_gpu),
            "status": p.status,
            "path": p.path,
            "gpus": str(p.gpus),
            "input_len": str(settings.input_len),
            "output_len": str(settings.output_len),
            "generated_tokens": "" if p.generated_tokens is None else str(p.generated_tokens),
            "rows_ended_early": str(p.rows_ended_early) if p.measured else "",
            "repeats": str(len(p.latencies_s)) if p.measured else "",
            "log": p.log,
        }
        for p in ranked(points)
    ]


def best_within(points: Sequence[Point], budget_ms: float | None) -> Point | None:
    """The highest tokens/s per GPU among the measured points within the latency budget."""
    fitting = [
        p
        for p in points
        if p.measured and (budget_ms is None or (p.latency_s or 0.0) * 1000 <= budget_ms)
    ]
    return max(fitting, key=lambda p: p.tokens_per_s_per_gpu or 0.0, default=None)


def describe(point: Point) -> dict[str, Any]:
    return {
        "path": point.path,
        "tp": point.tensor,
        "pp": point.pipeline,
        "batch": point.batch,
        "latency_ms": round((point.latency_s or 0.0) * 1000, 3),
        "tokens_per_s": point.tokens_per_s,
        "tokens_per_s_per_gpu": point.tokens_per_s_per_gpu,
    }


def label(point: Point) -> str:
    return f"{point.path} TP={point.tensor} PP={point.pipeline} batch {point.batch}"


def summary(points: Sequence[Point], settings: InferenceSettings, data_type: str) -> dict:
    budgets = []
    for budget in settings.max_latency_ms:
        best = best_within(points, budget)
        budgets.append({"max_latency_ms": budget, "best": describe(best) if best else None})
    best = best_within(points, None)
    fastest = min((p for p in points if p.measured), key=lambda p: p.latency_s or 0.0, default=None)
    return {
        "model_file": str(settings.model_file),
        "data_type": data_type,
        "input_len": settings.input_len,
        "output_len": settings.output_len,
        "combinations": len(points),
        "measured": sum(p.measured for p in points),
        "best_tokens_per_s_per_gpu": describe(best) if best else None,
        "lowest_latency": describe(fastest) if fastest else None,
        "best_per_latency_budget": budgets,
    }


def write(
    folder: Path, points: Sequence[Point], settings: InferenceSettings, data_type: str
) -> dict:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(COLUMNS), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows(points, settings))
    write_atomic(folder / "inference_results.csv", buffer.getvalue())
    # The name the NeMo launcher's AutoConfigurator documents for it (5.3.2.4).
    write_atomic(folder / "final_output.csv", buffer.getvalue())
    result = summary(points, settings, data_type)
    write_atomic(folder / "summary.json", json.dumps(result, indent=2) + "\n")
    plot(points, settings, folder / "inference_results.png")
    return result


def plot(points: Sequence[Point], settings: InferenceSettings, path: Path) -> bool:
    """Tokens/s per GPU against latency; False when nothing was measured or without
    matplotlib."""
    measured = [p for p in points if p.measured]
    plt = pyplot()
    if not measured or plt is None:
        return False
    figure, axes = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple[str, int, int], list[Point]] = {}
    for point in sorted(measured, key=lambda p: p.batch):
        series.setdefault((point.path, point.tensor, point.pipeline), []).append(point)
    for (path_name, tensor, pipeline), members in sorted(series.items()):
        xs = [(p.latency_s or 0.0) * 1000 for p in members]
        ys = [p.tokens_per_s_per_gpu or 0.0 for p in members]
        axes.plot(xs, ys, marker="o", label=f"{path_name} TP={tensor} PP={pipeline}")
        for p, x, y in zip(members, xs, ys, strict=True):
            axes.annotate(str(p.batch), (x, y), textcoords="offset points", xytext=(4, 4))
    for budget in settings.max_latency_ms:
        axes.axvline(budget, linestyle="--", color="grey", linewidth=1)
    latencies = [(p.latency_s or 0.0) * 1000 for p in measured]
    if min(latencies) > 0 and max(latencies) / min(latencies) > 20:
        axes.set_xscale("log")
    axes.set_xlabel("latency per request (ms); labels: batch size")
    axes.set_ylabel("generated tokens/s per GPU")
    axes.set_title(
        f"input {settings.input_len}, output {settings.output_len} tokens, "
        f"beam {settings.beam_width}"
    )
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True
