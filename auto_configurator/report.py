"""What a training search leaves in `<logs>/final_results/`.

candidates.csv        every candidate: layout, predicted memory and step time, then the measured
                      step time or why there is none (failed, not run, exceeds memory, invalid)
top_configs.log       the output_top_n fastest measured layouts, fastest first
optimal_config_*.yaml the fastest measured layout as a training recipe the launcher runs as is
failed_jobs.csv       the measured runs that failed, with the reason and the log
predicted_vs_measured.png   predicted against measured step time of each measured run
summary.json          the best run and the figures above, for scripts
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from auto_configurator.candidates import Evaluated
from auto_configurator.runner import Measurement, Run
from launcher_scripts.files import write_atomic

GIB = 2**30
COLUMNS = (
    "predicted_rank",
    "run",
    "tp",
    "pp",
    "vp",
    "cp",
    "ep",
    "sp",
    "mbs",
    "recompute",
    "dp",
    "micro_batches",
    "gbs",
    "status",
    "predicted_memory_gib",
    "memory_limit_gib",
    "predicted_step_time_s",
    "predicted_tflops_per_gpu",
    "measured_step_time_s",
    "measured_tflops_per_gpu",
    "measured_steps",
    "measured_peak_memory_gb",
    "failure",
    "run_dir",
)


@dataclass(frozen=True)
class Outcome:
    """A measured run with its place in the ranking."""

    run: Run
    evaluated: Evaluated
    measurement: Measurement


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None below two points."""
    if len(xs) < 2:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return cov / (vx * vy) ** 0.5 if vx and vy else None


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def measured_fastest(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """The measured runs, fastest first."""
    measured = [o for o in outcomes if o.measurement.measured]
    return sorted(measured, key=lambda o: o.measurement.step_time_s)


def _fmt(value: float | None, digits: int = 4) -> str:
    return "" if value is None else f"{value:.{digits}g}"


def candidate_rows(
    evaluated: Sequence[Evaluated], ranking: Sequence[Evaluated], outcomes: Sequence[Outcome]
) -> list[dict[str, str]]:
    """One row per candidate: measured (fastest first), failed, not run (by predicted rank),
    exceeds memory (least first), invalid."""
    rank_of = {id(e): i for i, e in enumerate(ranking, start=1)}
    outcome_of = {id(o.evaluated): o for o in outcomes}

    def order(e: Evaluated) -> tuple:
        outcome = outcome_of.get(id(e))
        if outcome and outcome.measurement.measured:
            return (0, outcome.measurement.step_time_s)
        if outcome:
            return (1, rank_of[id(e)])
        if e.feasible:
            return (2, rank_of[id(e)])
        if e.valid:
            return (3, e.memory.total)
        return (4, 0)

    rows = []
    for e in sorted(evaluated, key=order):
        c, layout, outcome = e.candidate, e.layout, outcome_of.get(id(e))
        m = outcome.measurement if outcome else None
        if m is not None:
            status = "measured" if m.measured else "failed"
        elif e.feasible:
            status = "not run (below limit_search_runs)"
        else:
            status = e.status
        rows.append(
            {
                "predicted_rank": str(rank_of.get(id(e), "")),
                "run": f"candidate_{outcome.run.index}" if outcome else "",
                "tp": str(c.tensor),
                "pp": str(c.pipeline),
                "vp": str(c.virtual_pipeline or ""),
                "cp": str(c.context),
                "ep": str(c.expert or ""),
                "sp": str(c.sequence_parallel).lower(),
                "mbs": str(c.micro_batch),
                "recompute": c.recompute or "none",
                "dp": str(layout.data),
                # A layout with more model-parallel ranks than GPUs has no data parallelism.
                "micro_batches": str(layout.micro_batches) if layout.data else "",
                "gbs": str(layout.global_batch),
                "status": status,
                "predicted_memory_gib": _fmt(e.memory.total / GIB if e.memory else None),
                "memory_limit_gib": _fmt(e.memory_limit / GIB),
                "predicted_step_time_s": _fmt(e.prediction.step_time_s if e.prediction else None),
                "predicted_tflops_per_gpu": _fmt(
                    e.prediction.tflops_per_gpu if e.prediction else None
                ),
                "measured_step_time_s": _fmt(m.step_time_s if m and m.measured else None),
                "measured_tflops_per_gpu": _fmt(m.tflops_per_gpu if m and m.measured else None),
                "measured_steps": str(m.steps) if m and m.measured else "",
                "measured_peak_memory_gb": _fmt(m.peak_memory_gb if m else None),
                "failure": (m.failure or "") if m else "",
                "run_dir": str(outcome.run.run_dir) if outcome else "",
            }
        )
    return rows


def _csv(rows: Sequence[dict[str, str]], columns: Sequence[str]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def top_table(outcomes: Sequence[Outcome], top_n: int) -> str:
    """The N fastest measured layouts as an aligned table."""
    header = ("#", "run", "layout", "measured s/step", "TFLOP/s/GPU", "predicted s/step", "rank")
    rows = [header]
    for i, o in enumerate(measured_fastest(outcomes)[:top_n], start=1):
        m, e = o.measurement, o.evaluated
        rows.append(
            (
                str(i),
                f"candidate_{o.run.index}",
                e.candidate.label,
                f"{m.step_time_s:.4g}",
                _fmt(m.tflops_per_gpu, 3),
                f"{e.prediction.step_time_s:.4g}",
                str(o.run.index),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def pyplot() -> Any:
    """matplotlib's pyplot drawing to files (Agg), or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(outcomes: Sequence[Outcome], path: Path, title: str) -> bool:
    """Predicted against measured step time of each measured run; False without matplotlib."""
    measured = measured_fastest(outcomes)
    plt = pyplot()
    if not measured or plt is None:
        return False
    xs = [o.evaluated.prediction.step_time_s for o in measured]
    ys = [o.measurement.step_time_s for o in measured]
    figure, axes = plt.subplots(figsize=(6, 4.5))
    axes.scatter(xs, ys)
    for o, x, y in zip(measured, xs, ys, strict=True):
        axes.annotate(str(o.run.index), (x, y), textcoords="offset points", xytext=(4, 4))
    rho = spearman(xs, ys)
    axes.set_xlabel("predicted step time (s)")
    axes.set_ylabel("measured step time (s)")
    axes.set_title(title + ("" if rho is None else f"  (Spearman {rho:.2f})"))
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def write_tables(
    folder: Path,
    evaluated: Sequence[Evaluated],
    ranking: Sequence[Evaluated],
    outcomes: Sequence[Outcome],
    top_n: int,
) -> None:
    rows = candidate_rows(evaluated, ranking, outcomes)
    write_atomic(folder / "candidates.csv", _csv(rows, COLUMNS))
    write_atomic(folder / "top_configs.log", top_table(outcomes, top_n) + "\n")
    failed = [
        {
            "run": f"candidate_{o.run.index}",
            "layout": o.evaluated.candidate.label,
            "state": o.measurement.state,
            "exit_code": "" if o.measurement.exit_code is None else str(o.measurement.exit_code),
            "failure": o.measurement.failure or "",
            "log": o.measurement.log or "",
        }
        for o in sorted(outcomes, key=lambda o: o.run.index)
        if not o.measurement.measured
    ]
    columns = ("run", "layout", "state", "exit_code", "failure", "log")
    write_atomic(folder / "failed_jobs.csv", _csv(failed, columns))


def write_summary(
    folder: Path,
    outcomes: Sequence[Outcome],
    best_config: Path | None,
    candidates: int,
    recipe_model: Any,
) -> dict:
    """summary.json; `recipe_model`: the base recipe's model section, which the best layout's
    overrides are written for."""
    fastest = measured_fastest(outcomes)
    measured_runs = [o for o in outcomes if o.measurement.measured]
    xs = [o.evaluated.prediction.step_time_s for o in measured_runs]
    ys = [o.measurement.step_time_s for o in measured_runs]
    summary = {
        "candidates": candidates,
        "runs": len(outcomes),
        "measured": len(measured_runs),
        "failed": len(outcomes) - len(measured_runs),
        "spearman_predicted_vs_measured": spearman(xs, ys),
        "best": None,
        "best_config": str(best_config) if best_config else None,
    }
    if fastest:
        best = fastest[0]
        summary["best"] = {
            "run": f"candidate_{best.run.index}",
            "predicted_rank": best.run.index,
            "layout": best.evaluated.candidate.label,
            "overrides": best.evaluated.candidate.overrides(recipe_model=recipe_model),
            "measured_step_time_s": best.measurement.step_time_s,
            "predicted_step_time_s": best.evaluated.prediction.step_time_s,
        }
    write_atomic(folder / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary
