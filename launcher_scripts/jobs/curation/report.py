"""data_curation's report: what each step did to the corpus, as markdown, JSON and a plot.

    python3 -m launcher_scripts.jobs.curation.report --config STAGE.yaml

Written to the stage's results folder: curation_report.md (documents and bytes in and out of
every step, why documents were removed with examples, duplicate-cluster sizes, the language
mix), curation_report.json (the same figures) and curation_report.png.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from launcher_scripts.files import replaced_file, write_atomic
from launcher_scripts.jobs.curation.work import Work, load_recipe, read_json, run_units, write_json


def gather(recipe: Any) -> dict[str, Any]:
    work = Work(recipe.work_dir)
    tasks = [read_json(work.document_stats(t)) for t in range(recipe.tasks)]
    written = [read_json(work.written(t)) for t in range(recipe.tasks)]
    steps: dict[str, Counter[str]] = {}
    removed: Counter[str] = Counter()
    examples: dict[str, list[dict[str, str]]] = {}
    languages: Counter[str] = Counter()
    bad: Counter[str] = Counter()
    bad_examples: dict[str, list[str]] = {}
    for stats in tasks:
        for name, figures in stats["steps"].items():
            steps.setdefault(name, Counter()).update(figures)
        removed.update(stats["removed"])
        languages.update(stats["languages"])
        bad.update(stats["bad_records"])
        for reason, shown in stats["examples"].items():
            examples.setdefault(reason, []).extend(shown)
        for reason, shown in stats["bad_examples"].items():
            bad_examples.setdefault(reason, []).extend(shown)
    dedup: dict[str, Any] = {}
    if recipe.deduplicates:
        buckets = Counter()
        for partition in range(recipe.partitions):
            buckets.update(read_json(work.bucket_stats(partition)))
        dedup = {**dict(buckets), **read_json(work.clusters)}
        dedup["examples"] = [e for w in written for e in w["duplicate_examples"]][:5]
    return {
        "documents_in": sum(t["documents_in"] for t in tasks),
        "bytes_in": sum(t["bytes_in"] for t in tasks),
        "records_read": sum(t["records_read"] for t in tasks),
        "bad_records": dict(bad),
        "bad_examples": {k: v[:3] for k, v in bad_examples.items()},
        # In the order they ran (the stats files are written with sorted keys).
        "steps": {step.name: dict(steps.get(step.name, {})) for step, _ in recipe.steps},
        "documents_kept_by_steps": sum(t["documents_kept"] for t in tasks),
        "removed": dict(removed.most_common()),
        "examples": {k: v[:3] for k, v in examples.items()},
        "dedup": dedup,
        "documents_out": sum(w["documents"] for w in written),
        "bytes_out": sum(w["bytes"] for w in written),
        "languages": dict(languages.most_common()),
        "output_dir": str(recipe.output_dir),
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Curation report",
        "",
        f"{report['documents_in']:,} documents ({report['bytes_in']:,} bytes) in, "
        f"{report['documents_out']:,} out, to {report['output_dir']}.",
        "",
    ]
    if report["bad_records"]:
        lines += [
            "## Records the source could not read",
            "",
            "| reason | records | e.g. |",
            "|---|---:|---|",
        ]
        for reason, count in report["bad_records"].items():
            lines.append(
                f"| {reason} | {count:,} | {'; '.join(report['bad_examples'].get(reason, []))} |"
            )
        lines.append("")
    lines += [
        "## Steps",
        "",
        "| step | documents in | out | bytes in | out |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, f in report["steps"].items():
        lines.append(
            f"| {name} | {f.get('documents_in', 0):,} | {f.get('documents_out', 0):,} | "
            f"{f.get('bytes_in', 0):,} | {f.get('bytes_out', 0):,} |"
        )
    dedup = report["dedup"]
    if dedup:
        lines.append(
            f"| dedup | {report['documents_kept_by_steps']:,} | {report['documents_out']:,} | | |"
        )
    lines += ["", "## Why documents were removed", "", "| step: reason | documents |", "|---|---:|"]
    lines += [f"| {reason} | {count:,} |" for reason, count in report["removed"].items()]
    if dedup:
        lines.append(f"| dedup: duplicate | {dedup['removed']:,} |")
    lines.append("")
    for reason, shown in report["examples"].items():
        lines.append(f"**{reason}**, e.g.:")
        lines += [f"- `{e['id']}`: {_quoted(e['text'])}" for e in shown]
        lines.append("")
    if dedup:
        lines += [
            "## Duplicates",
            "",
            f"{dedup['candidate_pairs']:,} candidate pairs, {dedup['verified_pairs']:,} "
            f"verified; {dedup['clusters']:,} clusters of {dedup['documents_in_clusters']:,} "
            f"documents, {dedup['removed']:,} removed.",
            "",
            "| cluster size | clusters |",
            "|---:|---:|",
        ]
        lines += [f"| {size} | {count:,} |" for size, count in dedup["cluster_sizes"].items()]
        lines.append("")
        lines += [f"- removed `{e['id']}`: {_quoted(e['text'])}" for e in dedup["examples"]]
        lines.append("")
    if report["languages"]:
        lines += ["## Languages kept", "", "| language | documents |", "|---|---:|"]
        lines += [f"| {code} | {count:,} |" for code, count in report["languages"].items()]
        lines.append("")
    return "\n".join(lines)


def _quoted(text: str) -> str:
    return " ".join(text.split())[:160].replace("|", "\\|")


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = plt.figure(figsize=(13, 8), layout="constrained")
    grid = figure.add_gridspec(2, 2)
    axes = [
        figure.add_subplot(grid[0, 0]),
        figure.add_subplot(grid[1, :]),
        figure.add_subplot(grid[0, 1]),
    ]
    names = list(report["steps"])
    kept = [report["steps"][n].get("documents_out", 0) for n in names]
    if report["dedup"]:
        names.append("dedup")
        kept.append(report["documents_out"])
    axes[0].bar(names, kept, color="tab:blue")
    axes[0].set_title(f"documents left after each step (of {report['documents_in']:,})")
    axes[0].tick_params(axis="x", rotation=30)
    reasons = list(report["removed"].items())[:12]
    if report["dedup"]:
        reasons.append(("dedup: duplicate", report["dedup"]["removed"]))
    axes[1].barh([r for r, _ in reasons], [c for _, c in reasons], color="tab:red")
    axes[1].set_title("documents removed, by reason")
    axes[1].invert_yaxis()
    sizes = report["dedup"].get("cluster_sizes", {}) if report["dedup"] else {}
    if sizes:
        axes[2].bar([int(s) for s in sizes], list(sizes.values()), color="tab:purple")
        axes[2].set_yscale("log")
        axes[2].set_title("duplicate clusters, by size")
    elif report["languages"]:
        axes[2].bar(list(report["languages"]), list(report["languages"].values()))
        axes[2].set_title("languages kept")
    with replaced_file(path) as temporary:
        figure.savefig(temporary, dpi=90)
    plt.close(figure)


def write_report(config: str, _unit: int) -> str:
    cfg, recipe = load_recipe(config)
    folder = Path(str(OmegaConf.select(cfg, "run.results_dir")))
    report = gather(recipe)
    write_json(folder / "curation_report.json", report)
    write_atomic(folder / "curation_report.md", markdown(report))
    plot(report, folder / "curation_report.png")
    return (
        f"curated {report['documents_in']:,} documents to {report['documents_out']:,}; "
        f"report: {folder / 'curation_report.md'}"
    )


def main(argv: list[str] | None = None) -> int:
    return run_units(
        argv,
        "data_curation's report: each step's effect, as markdown, JSON and a plot",
        lambda recipe: 1,
        None,  # redone each time
        write_report,
    )


if __name__ == "__main__":
    sys.exit(main())
