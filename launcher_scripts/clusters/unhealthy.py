"""The nodes cluster validation says to drain (`csp_tools/<csp>/cluster_validation.sh` writes
`<results>/<time>/verdict.json`), for `cluster.exclude_unhealthy`: the newest result counts.

Only the nodes validation confirmed bad (`drain`) are kept off; a node it could not retest
(`unconfirmed`) is not, since that would take good nodes out of service on a suspicion.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from launcher_scripts.errors import ConfigError

VALIDATE = "run bash csp_tools/<csp>/cluster_validation.sh --results-dir=<that folder>"


@dataclass(frozen=True)
class Unhealthy:
    nodes: list[str]  # in the verdict's order
    verdict: Path  # the file they come from


def newest_verdict(folder: Path) -> Path | None:
    """The verdict of the newest run under `folder` (run folders are named by their start
    time, so the last in name order is the newest)."""
    runs = sorted(folder.glob("*/verdict.json")) if folder.is_dir() else []
    return runs[-1] if runs else None


def unhealthy_nodes(folder: Path) -> Unhealthy:
    key = "cluster.validation_results"
    verdict = newest_verdict(folder)
    if verdict is None:
        raise ConfigError(
            key,
            f"{folder} holds no cluster validation result (<time>/verdict.json), which "
            "cluster.exclude_unhealthy=true reads",
            f"Validate the cluster first ({VALIDATE}), point {key} at the folder it wrote, or "
            "set cluster.exclude_unhealthy=false",
        )
    try:
        drain = json.loads(verdict.read_text())["drain"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(
            key,
            f"{verdict} is not a cluster validation verdict ({type(error).__name__}: {error})",
            f"Validate the cluster again ({VALIDATE}), or remove that run's folder",
        ) from None
    if not isinstance(drain, dict) or not all(isinstance(n, str) and n for n in drain):
        raise ConfigError(
            key,
            f"{verdict}: 'drain' is not a mapping of node names to reasons",
            f"Validate the cluster again ({VALIDATE}), or remove that run's folder",
        )
    return Unhealthy(nodes=list(drain), verdict=verdict)
