"""The bucket step of data_curation's dedup: one partition of the band keys of every task is
grouped; documents sharing a key are candidates, verified and written as edges.

    python3 -m launcher_scripts.jobs.curation.buckets --config STAGE.yaml [--workers N]

Exact-hash groups are duplicates as they are (a 128-bit content hash). A fuzzy candidate is
kept when its Jaccard similarity reaches the threshold: that of the two shingle sets
(verify=exact), or the agreeing fraction of the two signatures (verify=signature). Each
group's members are compared with its first member, those that fail with the first of the
rest, and so on. Writes work_dir/buckets/<p>.npy
(edges: task, doc, task, doc) and <p>.json (candidates and verified pairs).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import BinaryIO

import numpy as np

from launcher_scripts.curation.minhash import exact_jaccard
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
    """Every task's signatures (and shingle sets, for the exact check), read a document at a
    time from open files: a memory map would keep every page it touched resident, and the
    partition's step would grow with the corpus instead of with its partition."""

    def __init__(self, work: Work, num_hashes: int) -> None:
        self.work, self.num_hashes = work, num_hashes
        self.files: dict[Path, BinaryIO] = {}

    def _read(self, path: Path, start: int, count: int, dtype: type) -> np.ndarray:
        if path not in self.files:
            self.files[path] = path.open("rb")
        size = np.dtype(dtype).itemsize
        data = os.pread(self.files[path].fileno(), count * size, start * size)
        return np.frombuffer(data, dtype=dtype)

    def of(self, task: int, docs: np.ndarray) -> np.ndarray:
        path, width = self.work.signatures(task), self.num_hashes
        return np.stack([self._read(path, int(doc) * width, width, np.uint32) for doc in docs])

    def shingle_set(self, task: int, doc: int) -> np.ndarray:
        start, end = self._read(self.work.shingle_offsets(task), doc, 2, np.uint64)
        return self._read(self.work.shingles(task), int(start), int(end - start), np.uint64)

    def close(self) -> None:
        for stream in self.files.values():
            stream.close()


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
        found = _verified(members, signatures, fuzzy.threshold, fuzzy.verify == "exact")
        verified += len(found)
        if len(found):
            edges.append(found)
    if signatures is not None:
        signatures.close()
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


def _verified(
    members: np.ndarray, signatures: Signatures, threshold: float, exact: bool
) -> np.ndarray:
    """Edges from each member to the first member it is similar to, anchors taken in turn."""
    if exact:
        sets = [signatures.shingle_set(int(task), int(doc)) for task, doc in members]

        def similarity(anchor: int, rest: np.ndarray) -> np.ndarray:
            return np.array([exact_jaccard(sets[anchor], sets[other]) for other in rest])

    else:
        rows = np.concatenate(
            [
                signatures.of(int(t), members[members[:, 0] == t, 1])
                for t in np.unique(members[:, 0])
            ]
        )  # grouped by task, which is the members' order (sorted by task, doc)

        def similarity(anchor: int, rest: np.ndarray) -> np.ndarray:
            return (rows[rest] == rows[anchor]).mean(axis=1)

    remaining = np.arange(len(members))
    found = []
    for _ in range(MAX_ANCHORS):
        if len(remaining) < 2:
            break
        anchor, rest = remaining[0], remaining[1:]
        close = similarity(anchor, rest) >= threshold
        if close.any():
            found.append(_star(members[anchor], members[rest[close]]))
        remaining = rest[~close]
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
