"""The bucket step of data_curation's dedup: one partition of the band keys of every task is
grouped; documents sharing a key are candidates, verified and written as edges.

    python3 -m launcher_scripts.jobs.curation.buckets --config STAGE.yaml [--workers N]

Exact-hash groups are duplicates as they are (a 128-bit content hash). A fuzzy candidate is
kept when the agreeing fraction of the two full signatures (the estimated Jaccard
similarity) reaches the threshold: each group's members are compared with its first member,
those that fail with the first of the rest, and so on. Writes work_dir/buckets/<p>.npy
(edges: task, doc, task, doc) and <p>.json (candidates and verified pairs).
"""

from __future__ import annotations

import sys

import numpy as np

from launcher_scripts.jobs.curation.work import (
    BAND_RECORD,
    EXACT_BAND,
    Work,
    load_recipe,
    run_units,
    save_array,
    write_json,
)

# Rounds of anchors tried in one group; a group still unresolved after them is a cluster of
# band collisions between unrelated documents, not worth comparing pair by pair.
MAX_ANCHORS = 16


class Signatures:
    """Every task's signatures file, opened as arrays on first use."""

    def __init__(self, work: Work, num_hashes: int) -> None:
        self.work, self.num_hashes = work, num_hashes
        self.open: dict[int, np.ndarray] = {}

    def of(self, task: int, docs: np.ndarray) -> np.ndarray:
        if task not in self.open:
            path = self.work.signatures(task)
            self.open[task] = np.memmap(path, dtype=np.uint32, mode="r").reshape(
                -1, self.num_hashes
            )
        return np.asarray(self.open[task][docs])


def bucket_partition(config: str, partition: int) -> str:
    _cfg, recipe = load_recipe(config)
    work = Work(recipe.work_dir)
    parts = [
        np.fromfile(work.bands(task, partition), dtype=BAND_RECORD) for task in range(recipe.tasks)
    ]
    records = np.concatenate(parts) if parts else np.zeros(0, dtype=BAND_RECORD)
    order = np.lexsort(
        (records["doc"], records["task"], records["key2"], records["key"], records["band"])
    )
    records = records[order]
    same = (
        (records["band"][1:] == records["band"][:-1])
        & (records["key"][1:] == records["key"][:-1])
        & (records["key2"][1:] == records["key2"][:-1])
    )
    starts = np.flatnonzero(np.concatenate(([True], ~same)))
    ends = np.append(starts[1:], len(records))
    fuzzy = recipe.fuzzy_dedup
    signatures = Signatures(work, fuzzy.num_hashes) if fuzzy else None
    edges: list[np.ndarray] = []
    candidates = verified = 0
    for start, end in zip(starts[ends - starts > 1], ends[ends - starts > 1], strict=True):
        group = records[start:end]
        members = np.stack([group["task"], group["doc"]], axis=1)
        candidates += len(members) - 1
        if group["band"][0] == EXACT_BAND:
            edges.append(_star(members[0], members[1:]))
            verified += len(members) - 1
            continue
        found = _verified(members, signatures, fuzzy.threshold)
        verified += len(found)
        if len(found):
            edges.append(found)
    found_edges = (
        np.unique(np.concatenate(edges), axis=0) if edges else np.zeros((0, 4), dtype=np.uint32)
    )
    save_array(work.edges(partition), found_edges.astype(np.uint32))
    write_json(
        work.bucket_stats(partition),
        {"band_records": len(records), "candidate_pairs": candidates, "verified_pairs": verified},
    )
    return f"buckets partition {partition}: {candidates:,} candidate pairs, {verified:,} verified"


def _star(anchor: np.ndarray, others: np.ndarray) -> np.ndarray:
    return np.concatenate([np.broadcast_to(anchor, others.shape), others], axis=1)


def _verified(members: np.ndarray, signatures: Signatures, threshold: float) -> np.ndarray:
    rows = np.concatenate(
        [
            signatures.of(int(task), members[members[:, 0] == task, 1])
            for task in np.unique(members[:, 0])
        ]
    )
    # `rows` follows the members grouped by task, which is their order (sorted by task, doc).
    remaining = np.arange(len(members))
    found = []
    for _ in range(MAX_ANCHORS):
        if len(remaining) < 2:
            break
        anchor, rest = remaining[0], remaining[1:]
        agreement = (rows[rest] == rows[anchor]).mean(axis=1)
        close = rest[agreement >= threshold]
        if len(close):
            found.append(_star(members[anchor], members[close]))
        remaining = rest[agreement < threshold]
    return np.concatenate(found) if found else np.zeros((0, 4), dtype=np.uint32)


def main(argv: list[str] | None = None) -> int:
    return run_units(
        argv,
        "data_curation's dedup buckets: candidates of one key partition, verified",
        lambda recipe: recipe.partitions,
        lambda work, partition: work.bucket_stats(partition),
        bucket_partition,
    )


if __name__ == "__main__":
    sys.exit(main())
