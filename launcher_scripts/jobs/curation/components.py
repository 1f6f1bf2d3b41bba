"""The connected components of data_curation's dedup: every verified edge joins two
documents; each component keeps its first document (lowest task, then index) and removes
the rest.

    python3 -m launcher_scripts.jobs.curation.components --config STAGE.yaml

One process: it holds only the documents that have a duplicate (not the corpus), labelled by
min-label propagation with pointer jumping, vectorised. Writes work_dir/components/ whole:
removed/<task>.npy (sorted indexes of the task's kept documents to drop) and clusters.json
(the size of every duplicate cluster, counted).
"""

from __future__ import annotations

import sys
from collections import Counter

import numpy as np

from launcher_scripts.jobs.curation.work import (
    Work,
    load_recipe,
    read_json,
    run_units,
    unit_folder,
    write_json,
)


def labels_of(first: np.ndarray, second: np.ndarray, count: int) -> np.ndarray:
    """Each of `count` nodes' component label: the smallest node index in its component."""
    labels = np.arange(count)
    while True:
        before = labels.copy()
        low = np.minimum(labels[first], labels[second])
        np.minimum.at(labels, first, low)
        np.minimum.at(labels, second, low)
        while True:  # pointer jumping: a label's label, until they settle
            jumped = labels[labels]
            if np.array_equal(jumped, labels):
                break
            labels = jumped
        if np.array_equal(labels, before):
            return labels


def find_components(config: str, _unit: int) -> str:
    _cfg, recipe = load_recipe(config)
    work = Work(recipe.work_dir)
    kept = np.array(
        [read_json(work.document_stats(t))["documents_kept"] for t in range(recipe.tasks)]
    )
    offsets = np.concatenate(([0], np.cumsum(kept)))
    edges = [np.load(work.edges(p)) for p in range(recipe.partitions)]
    joined = np.concatenate(edges) if edges else np.zeros((0, 4), dtype=np.uint32)
    first = offsets[joined[:, 0]] + joined[:, 1]
    second = offsets[joined[:, 2]] + joined[:, 3]
    nodes = np.unique(np.concatenate([first, second]))
    labels = labels_of(np.searchsorted(nodes, first), np.searchsorted(nodes, second), len(nodes))
    removed = nodes[labels != np.arange(len(nodes))]
    roots = np.unique(labels)
    sizes = Counter(np.bincount(labels)[roots].tolist())
    with unit_folder(work.components) as folder:
        for task in range(recipe.tasks):
            mine = removed[(removed >= offsets[task]) & (removed < offsets[task + 1])]
            path = folder / "removed" / f"{task:05d}.npy"
            path.parent.mkdir(exist_ok=True)
            np.save(path, (mine - offsets[task]).astype(np.uint32))
        write_json(
            folder / "clusters.json",
            {
                "clusters": len(roots),
                "documents_in_clusters": int(len(nodes)),
                "removed": int(len(removed)),
                "cluster_sizes": {str(size): count for size, count in sorted(sizes.items())},
            },
        )
    return (
        f"components: {len(nodes):,} documents, {len(roots):,} clusters, {len(removed):,} removed"
    )


def main(argv: list[str] | None = None) -> int:
    return run_units(
        argv,
        "data_curation's dedup components: one document kept per duplicate cluster",
        lambda recipe: 1,
        lambda work, _unit: work.clusters,
        find_components,
    )


if __name__ == "__main__":
    sys.exit(main())
