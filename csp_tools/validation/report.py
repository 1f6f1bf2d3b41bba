"""The validation's report: tables a person reads (markdown), the same as JSON, a heatmap of
the measured pairs' busbw, and verdict.json, the nodes to drain, which the launcher's
`cluster.exclude_unhealthy` reads from the newest run."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from csp_tools.validation.screening import PairResult

VERDICT = "verdict.json"


def _write(path: Path, text: str) -> None:
    """Whole or not at all: a reader never finds half a report."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def node_table(nodes: list[str], node_reports: dict[str, dict], drain: dict[str, str]) -> str:
    lines = ["| node | result | checks |", "|---|---|---|"]
    for node in nodes:
        found = node_reports.get(node)
        checks = "<br>".join(
            f"{c['name']} {c['status']}: {c['detail']}" for c in (found or {}).get("checks", [])
        )
        result = "drain" if node in drain else ("pass" if found else "not probed")
        lines.append(f"| {node} | {result} | {checks or '-'} |")
    return "\n".join(lines) + "\n"


def pair_table(pairs: list[PairResult]) -> str:
    lines = ["| pair | busbw (GB/s) | note |", "|---|---|---|"]
    for pair in pairs:
        value = "-" if pair.busbw_gbps is None else f"{pair.busbw_gbps:.4g}"
        lines.append(f"| {pair.nodes[0]} - {pair.nodes[1]} | {value} | {pair.error or ''} |")
    return "\n".join(lines) + "\n"


def heatmap(path: Path, nodes: list[str], pairs: list[PairResult]) -> bool:
    """busbw of each measured pair, nodes on both axes (a failed pair: 0). False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    index = {node: i for i, node in enumerate(nodes)}
    grid = [[math.nan] * len(nodes) for _ in nodes]
    for pair in pairs:
        a, b = (index[n] for n in pair.nodes)
        value = pair.busbw_gbps if pair.busbw_gbps is not None else 0.0
        grid[a][b] = grid[b][a] = value
    size = max(4.0, 0.5 * len(nodes) + 2)
    figure, axes = plt.subplots(figsize=(size + 1, size))
    image = axes.imshow(grid, cmap="viridis")
    axes.set_xticks(range(len(nodes)), nodes, rotation=90)
    axes.set_yticks(range(len(nodes)), nodes)
    axes.set_title("all-reduce busbw of each measured pair (GB/s)")
    figure.colorbar(image, ax=axes)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True


def write(
    folder: Path,
    *,
    args: dict[str, Any],
    nodes: list[str],
    node_reports: dict[str, dict],
    pairs: list[PairResult],
    drain: dict[str, str],
    unconfirmed: dict[str, str],
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    _write(folder / "nodes.json", json.dumps(node_reports, indent=1) + "\n")
    _write(folder / "nodes.md", node_table(nodes, node_reports, drain))
    rows = [{"nodes": list(p.nodes), "busbw_gbps": p.busbw_gbps, "error": p.error} for p in pairs]
    _write(folder / "pairs.json", json.dumps(rows, indent=1) + "\n")
    _write(folder / "pairs.md", pair_table(pairs))
    if pairs:
        heatmap(folder / "pairs.png", nodes, pairs)
    verdict = {
        "command": {k: str(v) if isinstance(v, Path) else v for k, v in args.items()},
        "nodes": nodes,
        "drain": dict(sorted(drain.items())),
        "unconfirmed": dict(sorted(unconfirmed.items())),
        "passed": [n for n in nodes if n not in drain and n not in unconfirmed],
    }
    _write(folder / VERDICT, json.dumps(verdict, indent=1) + "\n")


def print_summary(
    nodes: list[str], drain: dict[str, str], unconfirmed: dict[str, str], folder: Path
) -> None:
    print(f"report: {folder}/nodes.md, {folder}/pairs.md, {folder}/pairs.png")
    for node, why in unconfirmed.items():
        print(f"unconfirmed: {node}: {why}")
    if drain:
        print(f"nodes to drain ({len(drain)} of {len(nodes)}): {','.join(sorted(drain))}")
        for node, why in sorted(drain.items()):
            print(f"  {node}: {why}")
    if unconfirmed:
        # No pair passed to retest against: the fault may be any node, or the network itself.
        print(
            f"{len(unconfirmed)} of {len(nodes)} nodes unconfirmed (no pair passed, so no node "
            "could be retested with a good partner): check the interconnect, or rerun with a "
            "node known to be good added to --nodelist"
        )
    if not drain and not unconfirmed:
        print(f"all {len(nodes)} nodes passed")
