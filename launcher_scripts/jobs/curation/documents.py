"""The document pass of data_curation: one logical task reads its share of the source and
runs each document through the recipe's steps in order (cleaning, language, heuristics,
classifier, decontamination...); the kept ones are written with their dedup keys.

    python3 -m launcher_scripts.jobs.curation.documents --config STAGE.yaml [--workers N]

Per task, in work_dir/documents/<task>/ (renamed into place when complete):
- kept.jsonl.zst: the kept documents, their index in this file being their dedup id;
- signatures.u32: their MinHash signatures, num_hashes uint32 each (fuzzy dedup);
- shingles.u64 and shingles.idx: their shingle sets, one after another, and where each
  starts (uint64, one more than the documents), for the exact check of candidates;
- bands/<partition>.bin: (key, key2, band, task, doc) records, LSH band keys and the exact
  content hash, partitioned by key for the bucket step;
- stats.json: documents and bytes in and out of each step, removals by reason with
  examples, languages, and the records the source could not read.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
import zstandard

from launcher_scripts.curation.document import Document
from launcher_scripts.curation.minhash import MinHasher, band_keys
from launcher_scripts.curation.sources import ReadStats
from launcher_scripts.curation.step import LANGUAGE
from launcher_scripts.errors import JobError
from launcher_scripts.jobs.curation.work import (
    BAND_RECORD,
    EXACT_BAND,
    Work,
    load_recipe,
    run_units,
    unit_folder,
    write_json,
)

EXAMPLES = 3  # removed documents shown per reason
EXAMPLE_CHARS = 300
FLUSH_RECORDS = 65536  # band records a partition buffers before it is appended to its file


class StepStats:
    def __init__(self) -> None:
        self.documents_in = self.bytes_in = self.documents_out = self.bytes_out = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "documents_in": self.documents_in,
            "bytes_in": self.bytes_in,
            "documents_out": self.documents_out,
            "bytes_out": self.bytes_out,
        }


class Removals:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, list[dict[str, str]]] = {}

    def add(self, reason: str, doc: Document, text: str) -> None:
        self.counts[reason] += 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < EXAMPLES:
            shown.append({"id": doc.id, "text": text[:EXAMPLE_CHARS]})


class BandWriter:
    """Band records appended per partition file, buffered."""

    def __init__(self, folder: Path, partitions: int) -> None:
        self.folder, self.partitions = folder, partitions
        folder.mkdir(parents=True, exist_ok=True)
        self.buffers: list[list[tuple[int, int, int, int, int]]] = [[] for _ in range(partitions)]
        for partition in range(partitions):
            self._path(partition).touch()

    def _path(self, partition: int) -> Path:
        return self.folder / f"{partition:04d}.bin"

    def add(self, key: int, key2: int, band: int, task: int, doc: int) -> None:
        buffer = self.buffers[key % self.partitions]
        buffer.append((key, key2, band, task, doc))
        if len(buffer) >= FLUSH_RECORDS:
            self._flush(key % self.partitions)

    def _flush(self, partition: int) -> None:
        buffer = self.buffers[partition]
        if buffer:
            with self._path(partition).open("ab") as stream:
                stream.write(np.array(buffer, dtype=BAND_RECORD).tobytes())
            buffer.clear()

    def close(self) -> None:
        for partition in range(self.partitions):
            self._flush(partition)


def curate_task(config: str, task: int) -> str:
    _cfg, recipe = load_recipe(config)
    work = Work(recipe.work_dir)
    steps = [(step.name, step.build(section, recipe.work_dir)) for step, section in recipe.steps]
    fuzzy = recipe.fuzzy_dedup
    hasher = MinHasher(fuzzy.num_hashes, fuzzy.ngram, fuzzy.seed) if fuzzy else None
    step_stats = {name: StepStats() for name, _ in steps}
    removals, languages, read = Removals(), Counter(), ReadStats()
    documents_in = bytes_in = kept = bytes_kept = 0
    with unit_folder(work.documents(task)) as folder:
        bands = BandWriter(folder / "bands", recipe.partitions) if recipe.deduplicates else None
        compressor = zstandard.ZstdCompressor(level=3)
        with (
            (folder / "kept.jsonl.zst").open("wb") as raw,
            compressor.stream_writer(raw) as kept_stream,
            (folder / "signatures.u32").open("wb") as signatures,
            (folder / "shingles.u64").open("wb") as shingles,
        ):
            keys = KeyWriter(recipe, hasher, bands, signatures, shingles, task)
            for path in recipe.task_files(task):
                for doc in recipe.source.read(path, recipe.source_section, read):
                    size = len(doc.text.encode("utf-8"))
                    documents_in += 1
                    bytes_in += size
                    if not doc.text.strip():
                        removals.add("source: no_text", doc, doc.text)
                        continue
                    reason = _run_steps(steps, step_stats, doc, size, removals)
                    if reason is not None:
                        continue
                    if LANGUAGE in doc.meta:
                        languages[str(doc.meta[LANGUAGE])] += 1
                    line = json.dumps(doc.record(), ensure_ascii=False) + "\n"
                    kept_stream.write(line.encode("utf-8"))
                    encoded = doc.text.encode("utf-8")
                    bytes_kept += len(encoded)
                    if bands is not None:
                        keys.add(doc.text, encoded, kept)
                    kept += 1
        if bands is not None:
            bands.close()
        if keys.offsets is not None:
            np.array(keys.offsets, dtype=np.uint64).tofile(folder / "shingles.idx")
        _check_bad(recipe.max_bad_fraction, read, task)
        stats: dict[str, Any] = {
            "task": task,
            "documents_in": documents_in,
            "bytes_in": bytes_in,
            "documents_kept": kept,
            "bytes_kept": bytes_kept,
            "steps": {name: s.as_dict() for name, s in step_stats.items()},
            "removed": dict(removals.counts),
            "examples": removals.examples,
            "languages": dict(languages),
            "records_read": read.records,
            "bad_records": dict(read.bad),
            "bad_examples": read.examples,
        }
        write_json(folder / "stats.json", stats)
    bad = sum(read.bad.values())
    return f"documents task {task}: {documents_in:,} in, {kept:,} kept" + (
        f", {bad:,} unreadable records skipped" if bad else ""
    )


def _run_steps(
    steps: list[tuple[str, Any]],
    stats: dict[str, StepStats],
    doc: Document,
    size: int,
    removals: Removals,
) -> str | None:
    for name, step in steps:
        counted = stats[name]
        counted.documents_in += 1
        counted.bytes_in += size
        text_before = doc.text
        reason = step(doc)
        if reason is not None:
            removals.add(f"{name}: {reason}", doc, text_before)
            return reason
        if doc.text is not text_before:
            size = len(doc.text.encode("utf-8"))
        counted.documents_out += 1
        counted.bytes_out += size
    return None


class KeyWriter:
    """A kept document's dedup keys: its exact content hash, and its MinHash signature, band
    keys and (for the exact check) shingle set."""

    def __init__(
        self,
        recipe: Any,
        hasher: MinHasher | None,
        bands: BandWriter | None,
        signatures: Any,
        shingles: Any,
        task: int,
    ) -> None:
        self.recipe, self.hasher, self.bands, self.task = recipe, hasher, bands, task
        self.signatures, self.shingles = signatures, shingles
        fuzzy = recipe.fuzzy_dedup
        self.offsets: list[int] | None = [0] if fuzzy and fuzzy.verify == "exact" else None

    def add(self, text: str, encoded: bytes, index: int) -> None:
        assert self.bands is not None
        if self.recipe.exact_dedup:
            digest = xxhash.xxh3_128_intdigest(encoded)
            self.bands.add(
                digest >> 64, digest & 0xFFFFFFFFFFFFFFFF, int(EXACT_BAND), self.task, index
            )
        if self.hasher is not None:
            shingles = self.hasher.shingles(text)
            signature = self.hasher.signature(shingles)
            self.signatures.write(signature.tobytes())
            for band, key in enumerate(band_keys(signature, self.recipe.fuzzy_dedup.banding)):
                self.bands.add(key, 0, band, self.task, index)
            if self.offsets is not None:
                self.shingles.write(shingles.tobytes())
                self.offsets.append(self.offsets[-1] + len(shingles))


def _check_bad(limit: float, read: ReadStats, task: int) -> None:
    bad = sum(read.bad.values())
    if read.records and bad / read.records > limit:
        reason, examples = read.bad.most_common(1)[0][0], read.examples
        raise JobError(
            f"task {task}: {bad:,} of {read.records:,} records could not be read (more than "
            f"max_bad_fraction={limit}); most are {reason}, e.g. {examples[reason][0]}. Fix "
            "the input or raise data_curation.max_bad_fraction"
        )


def main(argv: list[str] | None = None) -> int:
    return run_units(
        argv,
        "data_curation's document pass: the steps run on this task's share of the source",
        lambda recipe: recipe.tasks,
        lambda work, task: work.document_stats(task),
        curate_task,
    )


if __name__ == "__main__":
    sys.exit(main())
