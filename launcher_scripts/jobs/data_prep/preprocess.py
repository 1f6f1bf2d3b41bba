"""Tokenize JSON-lines / JSON / gzip / text-directory datasets into Megatron indexed datasets.

    python3 -m launcher_scripts.jobs.data_prep.preprocess --input data/*.jsonl \\
        --output-dir out --tokenizer-model tokenizer.json --workers 8

Each input becomes one shard `<output-dir>/<output-prefix><stem>_<text-key>_document.{bin,idx}`,
or `..._sentence` with --split-sentences (BERT data: each sentence a sequence, grouped by
document in the .idx; sentences.py has the splitting rules).
Inputs are shared among the job's tasks by rank (shards.share); inside a task the work is cut
into units (byte ranges of big JSONL files, whole gzip files, groups of text files) that
`--workers` forked processes encode, each into a partial dataset that the main process merges
into the shard once all its units are done. Workers read their own byte ranges, so no text
crosses a process boundary: only unit numbers go out and counts come back.

A shard whose .idx is present and consistent is complete; it is skipped when its record
(fingerprint.py) says it was made from the same input (size and mtime), the same tokenizer
(its files' hashes) and the same settings, so a re-run after a failure redoes only what is
missing, and a re-run with another tokenizer or changed inputs redoes what they change, saying
why. Exit status: 0 done, 1 failed (too many bad records in an input, or an error, told in one
line).
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    # The job multiplies no matrices, yet importing numpy starts OpenBLAS's thread pool, whose
    # threads spin for about a tenth of a second of CPU after start: CPU that the tokenizing
    # workers need. With one thread there is no pool. (Set before numpy is imported; a value
    # the caller set wins.)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import gzip
import math
import multiprocessing
import queue
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from launcher_scripts.formats import fingerprint, indexed_writer, shards
from launcher_scripts.formats.tokenizer import (
    DocumentTokenizer,
    TokenizerError,
    TokenizerSpec,
    load_tokenizer,
    use_single_thread,
)
from launcher_scripts.jobs.data_prep import readers

# Byte ranges of one JSONL file: at least this big (per-unit costs stay negligible) ...
MIN_RANGE_BYTES = 16 << 20
# ... and at most this big (a failure or a slow unit never holds more than this).
MAX_RANGE_BYTES = 1 << 30
# Units per worker for one file: more than one lets a fast worker take over a slow one's
# share at the end; few enough that merging stays cheap.
UNITS_PER_WORKER = 2
BATCH_BYTES = 1 << 20


class DataPrepError(Exception):
    """An expected failure, reported as one line without a traceback."""


@dataclass(frozen=True)
class Shard:
    input: Path
    prefix: Path  # output path without .bin/.idx

    @property
    def name(self) -> str:
        return self.prefix.name

    @property
    def parts_dir(self) -> Path:
        return self.prefix.with_name(f".{self.name}.parts")


@dataclass(frozen=True)
class WorkUnit:
    """A piece of one shard's input that one worker encodes into one partial dataset."""

    shard: int
    part: int
    # "range": bytes [start, end) of a JSONL file; "file": a whole file; "texts": text files
    kind: str
    path: str
    size: int  # input bytes, for progress and scheduling
    start: int = 0
    end: int = 0
    files: tuple[str, ...] = ()

    def part_prefix(self, shard: Shard) -> Path:
        return shard.parts_dir / f"part-{self.part:05d}"


@dataclass
class UnitResult:
    shard: int
    part: int
    documents: int
    empty: int
    tokens: int
    stats: readers.ReadStats


@dataclass(frozen=True)
class EncodeOptions:
    text_key: str
    dtype: type
    append_eod: bool
    split_sentences: bool = False


@dataclass
class Totals:
    documents: int = 0
    empty: int = 0
    tokens: int = 0
    input_bytes: int = 0
    bad: int = 0
    written: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 -m launcher_scripts.jobs.data_prep.preprocess",
        description="Tokenize datasets into Megatron-Core indexed datasets (.bin/.idx).",
    )
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="files (.json, .jsonl, .json.gz, .jsonl.gz) or directories of text files",
    )
    parser.add_argument("--output-dir", required=True, metavar="DIR")
    parser.add_argument(
        "--output-prefix",
        default="",
        metavar="STR",
        help="prepended to each shard name <stem>_<text-key>_document",
    )
    parser.add_argument("--text-key", default="text", help="JSON key of the document text")
    parser.add_argument(
        "--tokenizer-model",
        metavar="PATH",
        help="SentencePiece .model, or Hugging Face tokenizer.json (by suffix .json)",
    )
    parser.add_argument(
        "--vocab-file",
        metavar="PATH",
        help="GPT-2 BPE vocab.json (with --merge-file), or alone a BERT WordPiece vocab.txt",
    )
    parser.add_argument("--merge-file", metavar="PATH", help="GPT-2 BPE merges.txt")
    parser.add_argument(
        "--lower-case",
        action="store_true",
        help="WordPiece: lower-case and strip accents first (BertWordPieceLowerCase)",
    )
    parser.add_argument(
        "--split-sentences",
        action="store_true",
        help="one sequence per sentence, grouped by document (BERT); shards end in _sentence",
    )
    parser.add_argument("--eod-token", metavar="STR", help="end-of-document token to append")
    parser.add_argument(
        "--no-append-eod",
        action="store_true",
        help="do not append the end-of-document token to each document",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=_usable_cpus(),
        metavar="N",
        help="worker processes in this task (default: all CPUs this process may use)",
    )
    parser.add_argument("--rank", type=int, metavar="R", help="this task's rank")
    parser.add_argument("--world-size", type=int, metavar="W", help="number of tasks")
    parser.add_argument(
        "--max-bad-fraction",
        type=float,
        default=0.01,
        metavar="F",
        help="fail when bad records / all records of an input exceed this",
    )
    parser.add_argument(
        "--remove-inputs", action="store_true", help="delete each input once its shard is complete"
    )
    parser.add_argument(
        "--engine",
        default="auto",
        choices=("auto", "gigatoken", "tokenizers"),
        help="BPE engine (auto: gigatoken when its ids equal tokenizers')",
    )
    return parser


def _usable_cpus() -> int:
    # The CPUs of this process's affinity mask: a Slurm task confined to some of the node's
    # cores must not start a worker for every core of the node.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def shard_for(
    path: Path, output_dir: Path, output_prefix: str, text_key: str, sentences: bool = False
) -> Shard:
    """Megatron's name for the dataset made from `path`: ..._document, or ..._sentence when
    split into sentences."""
    stem = readers.dataset_stem(path)
    level = "sentence" if sentences else "document"
    return Shard(path, output_dir / f"{output_prefix}{stem}_{text_key}_{level}")


def plan_shards(args: argparse.Namespace) -> list[Shard]:
    """Every input's shard (all ranks'), checked for clashing names.

    Only names are looked at: under a task-to-task chain (Slurm's aftercorr) the inputs of other
    tasks may still be being written. Each task checks its own with check_inputs.
    """
    output_dir = Path(args.output_dir)
    result: list[Shard] = []
    seen: dict[str, Path] = {}
    for raw in args.input:
        path = Path(raw)
        shard = shard_for(path, output_dir, args.output_prefix, args.text_key, args.split_sentences)
        if shard.name in seen:
            raise DataPrepError(
                f"inputs {seen[shard.name]} and {path} both make shard {shard.name}"
            )
        seen[shard.name] = path
        result.append(shard)
    return result


def check_inputs(shards: list[Shard]) -> None:
    for shard in shards:
        path = shard.input
        if not path.exists():
            raise DataPrepError(f"input {path} does not exist")
        if not path.is_dir() and not readers.is_json_input(path):
            raise DataPrepError(
                f"input {path}: give .json, .jsonl, .json.gz, .jsonl.gz files or directories"
            )


# Bumped when the same inputs, tokenizer and settings would give other bytes.
OUTPUT_FORMAT = 1


def tokenizer_spec(args: argparse.Namespace) -> TokenizerSpec:
    return TokenizerSpec(
        args.tokenizer_model,
        args.vocab_file,
        args.merge_file,
        args.eod_token,
        args.engine,
        args.lower_case,
    )


def made_from(args: argparse.Namespace, inputs: Sequence[Path]) -> fingerprint.Fingerprint:
    """The fingerprint of a dataset this job makes from `inputs` with these arguments.

    The engine, the worker count and --max-bad-fraction are left out: they do not change
    the bytes written.
    """
    settings = {
        "format": OUTPUT_FORMAT,
        "text_key": args.text_key,
        "append_eod": not args.no_append_eod,
        "eod_token": args.eod_token,
        "split_sentences": args.split_sentences,
        "lower_case": args.lower_case,
    }
    tokenizer = {
        "model": args.tokenizer_model,
        "vocab_file": args.vocab_file,
        "merge_file": args.merge_file,
    }
    return fingerprint.make(settings, inputs, tokenizer)


def stale_reasons(prefix: Path, wanted: fingerprint.Fingerprint) -> list[str]:
    """Why the complete dataset at `prefix` does not match `wanted`; empty when it does."""
    return fingerprint.stale_reasons(fingerprint.recorded_fingerprint(prefix), wanted)


def plan_units(shard_index: int, shard: Shard, workers: int) -> list[WorkUnit]:
    """Cut one shard's input into work units, in output order."""
    path = shard.input
    if path.is_dir():
        shards = readers.json_shards(path)
        if shards is not None:  # each a whole-file unit, merged in name order
            return [
                WorkUnit(shard_index, k, "file", str(f), f.stat().st_size)
                for k, f in enumerate(shards)
            ]
        return _text_units(shard_index, readers.text_files(path), workers)
    size = path.stat().st_size
    if readers.is_gzip(path) or _is_json_array(path):
        return [WorkUnit(shard_index, 0, "file", str(path), size)]
    pieces = max(
        math.ceil(size / MAX_RANGE_BYTES),
        min(_unit_count(workers), math.ceil(size / MIN_RANGE_BYTES)),
        1,
    )
    # Plain byte bounds: each worker aligns its own range to whole lines.
    bounds = [size * k // pieces for k in range(pieces + 1)]
    return [
        WorkUnit(shard_index, k, "range", str(path), end - start, start, end)
        for k, (start, end) in enumerate(zip(bounds, bounds[1:], strict=False))
    ]


def _unit_count(workers: int) -> int:
    """Units to cut one input into. A lone worker has no one to take over from: one unit
    spares it merging parts (a copy of the whole shard)."""
    return workers * UNITS_PER_WORKER if workers > 1 else 1


def _is_json_array(path: Path) -> bool:
    with open(path, "rb") as stream:
        return readers.starts_with_array(stream)


def _text_units(shard_index: int, files: list[Path], workers: int) -> list[WorkUnit]:
    sizes = [file.stat().st_size for file in files]
    target = max(sum(sizes) // _unit_count(workers), MIN_RANGE_BYTES)
    units: list[WorkUnit] = []
    group: list[str] = []
    group_size = 0
    for file, size in zip(files, sizes, strict=True):
        group.append(str(file))
        group_size += size
        if group_size >= target:
            units.append(
                WorkUnit(shard_index, len(units), "texts", "", group_size, files=tuple(group))
            )
            group, group_size = [], 0
    if group or not units:
        units.append(WorkUnit(shard_index, len(units), "texts", "", group_size, files=tuple(group)))
    return units


# ---- worker side -------------------------------------------------------------------------


def _unit_batches(
    unit: WorkUnit, text_key: str, stats: readers.ReadStats
) -> Iterator[tuple[list[str], int]]:
    """(texts, input bytes consumed so far) for one unit."""
    if unit.kind == "texts":
        for texts in readers.iter_text_files(unit.files, stats, BATCH_BYTES):
            yield texts, min(stats.bytes_read, unit.size)
        yield [], unit.size
        return
    if unit.kind == "range":
        batches = readers.iter_jsonl_range(
            unit.path, unit.start, unit.end, text_key, stats, BATCH_BYTES
        )
        for texts in batches:
            yield texts, min(stats.bytes_read, unit.size)
        yield [], unit.size
        return
    with readers.open_input(unit.path) as stream:
        raw = _raw_file(stream)
        if readers.starts_with_array(stream):
            batches = readers.iter_json_array(stream, unit.path, text_key, stats, BATCH_BYTES)
        else:
            batches = readers.iter_jsonl_stream(
                stream, unit.path, text_key, stats, None, BATCH_BYTES
            )
        for texts in batches:
            yield texts, raw.tell()
    yield [], unit.size


def _raw_file(stream: BinaryIO) -> BinaryIO:
    """The file under a (gzip) reader, whose position counts compressed bytes read."""
    inner: Any = stream
    while hasattr(inner, "raw") or hasattr(inner, "fileobj"):
        inner = getattr(inner, "raw", None) or inner.fileobj
    return inner


def run_unit(
    unit: WorkUnit,
    shard: Shard,
    tokenizer: DocumentTokenizer,
    options: EncodeOptions,
    progress: Callable[[int, int], None],
) -> UnitResult:
    """Encode one unit into its partial dataset; progress(bytes, documents) as it goes."""
    stats = readers.ReadStats()
    documents = empty = 0
    reported = 0
    with indexed_writer.IndexedDatasetWriter(unit.part_prefix(shard), options.dtype) as writer:
        for texts, consumed in _unit_batches(unit, options.text_key, stats):
            within_batch = _BatchProgress(consumed - reported, progress)
            if texts:
                kept = _encode_into(writer, tokenizer, texts, options, within_batch.encoded)
                documents += kept
                # Documents with no tokens (empty text, or whitespace a SentencePiece model
                # normalises away) were dropped even though an EOD alone would be a sequence:
                # it would carry no text, only a document boundary for GPTDataset to sample.
                empty += len(texts) - kept
            progress(within_batch.rest(), len(texts))
            reported = consumed
    return UnitResult(unit.shard, unit.part, documents, empty, writer.tokens, stats)


@dataclass
class _BatchProgress:
    """A batch's bytes reported as its long documents' pieces are encoded (their share of the
    batch), so that progress and its ETA move within a document of many megabytes."""

    size: int  # the batch's bytes of input
    progress: Callable[[int, int], None]
    shown: int = 0

    def encoded(self, done: int, total: int) -> None:
        share = self.size * done // max(total, 1)
        self.progress(share - self.shown, 0)
        self.shown = share

    def rest(self) -> int:
        return self.size - self.shown


def _encode_into(
    writer: indexed_writer.IndexedDatasetWriter,
    tokenizer: DocumentTokenizer,
    texts: list[str],
    options: EncodeOptions,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Encode a batch into `writer`; returns the number of documents kept. `progress`: see
    DocumentTokenizer.encode_documents."""
    if options.split_sentences:
        flat, lengths, per_document = tokenizer.encode_sentences(
            texts, options.dtype, options.append_eod
        )
        writer.add_documents(flat, lengths, per_document)
        return int(per_document.size)
    flat, lengths = tokenizer.encode_documents(texts, options.dtype, options.append_eod, progress)
    writer.add_documents(flat, lengths)
    return int(lengths.size)


@dataclass
class _WorkerState:
    units: Sequence[WorkUnit]
    shards: Sequence[Shard]
    spec: TokenizerSpec
    options: EncodeOptions


# What reading a truncated or corrupt input raises (gzip: EOFError, BadGzipFile, zlib.error).
UNREADABLE_INPUT: tuple[type[BaseException], ...] = (EOFError, gzip.BadGzipFile, zlib.error)

# Set in the parent before forking, so forked workers share the loaded tokenizer; a spawned
# worker (platforms without fork) loads its own from the spec.
_INHERITED: DocumentTokenizer | None = None


def _worker_main(state: _WorkerState, tasks: TaskChannel, results: Any) -> None:
    # Ctrl-C reaches the whole process group: the parent alone reacts, by terminating us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    tasks.worker_side()
    use_single_thread()
    tokenizer = _INHERITED or load_tokenizer(state.spec)
    while (index := tasks.get()) is not None:
        unit = state.units[index]

        def progress(consumed: int, docs: int) -> None:
            results.put(("progress", consumed, docs))

        try:
            result = run_unit(unit, state.shards[unit.shard], tokenizer, state.options, progress)
        except UNREADABLE_INPUT as error:
            # A damaged input, not a bug: the parent prints one line, no traceback.
            results.put(("unreadable", index, f"{type(error).__name__}: {error}"))
            return
        except Exception:
            results.put(("error", index, traceback.format_exc()))
            return
        results.put(("done", index, result))


class TaskChannel:
    """Unit numbers from the parent to whichever worker asks first, over one pipe.

    Workers close their copy of the writing end, so a worker whose parent died (killed with
    no chance to clean up) reads end-of-file and exits instead of waiting forever.
    """

    def __init__(self, context: Any) -> None:
        self._reader, self._writer = context.Pipe(duplex=False)
        self._lock = context.Lock()

    def put(self, index: int | None) -> None:
        self._writer.send(index)

    def get(self) -> int | None:
        with self._lock:
            try:
                return self._reader.recv()
            except EOFError:
                return None

    def worker_side(self) -> None:
        self._writer.close()

    def parent_side(self) -> None:
        self._reader.close()


class WorkerPool:
    """N processes pulling unit numbers from a TaskChannel; messages come back on a queue."""

    def __init__(self, workers: int, state: _WorkerState) -> None:
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        context = multiprocessing.get_context(method)
        self.tasks = TaskChannel(context)
        self.results = context.Queue()
        # Fork before any thread exists in this process (queue feeders, progress monitor).
        self.processes = [
            context.Process(
                target=_worker_main,
                args=(state, self.tasks, self.results),
                daemon=True,
                name=f"data-prep-worker-{k}",
            )
            for k in range(workers)
        ]
        for process in self.processes:
            process.start()
        self.tasks.parent_side()

    def submit_all(self, indices: Sequence[int]) -> None:
        for index in indices:
            self.tasks.put(index)
        for _ in self.processes:
            self.tasks.put(None)

    def messages(self) -> Iterator[tuple[Any, ...]]:
        """Worker messages until the caller stops; raises when a worker dies silently."""
        while True:
            try:
                yield self.results.get(timeout=1.0)
            except queue.Empty:
                for process in self.processes:
                    if process.exitcode not in (None, 0):
                        raise DataPrepError(
                            f"worker {process.name} died with exit code {process.exitcode} "
                            "(killed, e.g. out of memory?)"
                        ) from None

    def close(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(timeout=10)
        self.results.cancel_join_thread()


# ---- main side ---------------------------------------------------------------------------


class ShardAssembler:
    """Collects unit results and, once a shard has all of them, publishes or rejects it."""

    def __init__(
        self,
        shards: Sequence[Shard],
        units: Sequence[WorkUnit],
        args: argparse.Namespace,
        totals: Totals,
    ) -> None:
        self.shards = shards
        self.args = args
        self.totals = totals
        self.expected: dict[int, int] = {}
        for unit in units:
            self.expected[unit.shard] = self.expected.get(unit.shard, 0) + 1
        self.results: dict[int, list[UnitResult]] = {index: [] for index in self.expected}
        # Taken before the workers read: the record says what the data was made from.
        self.origins = {index: made_from(args, [shards[index].input]) for index in self.expected}

    def add(self, result: UnitResult) -> None:
        collected = self.results[result.shard]
        collected.append(result)
        if len(collected) == self.expected[result.shard]:
            parts = sorted(collected, key=lambda r: r.part)
            self._finish(self.shards[result.shard], parts, self.origins[result.shard])
            del self.results[result.shard]

    def _finish(
        self, shard: Shard, parts: list[UnitResult], origin: fingerprint.Fingerprint
    ) -> None:
        stats = readers.ReadStats()
        for part in parts:
            # Line numbers of a byte range count from its first line: shift by the lines before.
            stats.merge(part.stats, line_offset=stats.lines)
        for line in readers.report_bad(stats, str(shard.input)):
            print(line, file=sys.stderr)
        self.totals.bad += stats.bad
        fraction = stats.bad / stats.records if stats.records else 0.0
        if fraction > self.args.max_bad_fraction:
            shutil.rmtree(shard.parts_dir, ignore_errors=True)
            self.totals.failures.append(
                f"{shard.input}: {stats.bad} of {stats.records} records ({fraction:.2%}) are bad, "
                f"more than --max-bad-fraction {self.args.max_bad_fraction:g}"
            )
            return
        prefixes = [shard.parts_dir / f"part-{part.part:05d}" for part in parts]
        publish_parts(prefixes, shard.prefix, origin)
        shutil.rmtree(shard.parts_dir, ignore_errors=True)
        documents = sum(part.documents for part in parts)
        empty = sum(part.empty for part in parts)
        self.totals.documents += documents
        self.totals.empty += empty
        self.totals.tokens += sum(part.tokens for part in parts)
        self.totals.written += 1
        if documents == 0:
            print(f"warning: {shard.name} has no documents", file=sys.stderr)
        if self.args.remove_inputs:
            remove_input(shard.input)


def publish_parts(
    parts: Sequence[Path], prefix: Path, made_from: fingerprint.Fingerprint | None
) -> None:
    """Make the partial datasets `parts` the dataset at `prefix`, recorded with `made_from`,
    the .idx last."""
    if len(parts) == 1:
        # A single part is already a complete dataset: renaming it avoids copying the .bin.
        part = parts[0]
        stats = indexed_writer.read_stats(part) or {}
        header = indexed_writer.read_header(indexed_writer.idx_path(part))
        tokens = indexed_writer.bin_path(part).stat().st_size // np.dtype(header.dtype).itemsize
        record = indexed_writer.dataset_record(
            header.dtype, tokens, stats.get("max_token_id"), made_from
        )
        indexed_writer.publish_files(
            indexed_writer.bin_path(part), indexed_writer.idx_path(part), prefix, record
        )
        fingerprint.remove_record(part)
    else:
        indexed_writer.merge_datasets(parts, prefix, made_from)


def remove_input(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    fingerprint.remove_record(path)  # the extract step's record of it, if any


def select_work(shards: Sequence[Shard], args: argparse.Namespace, totals: Totals) -> list[int]:
    """Indices of the shards still to make. Complete ones made from the same inputs, tokenizer
    and settings are skipped (and their inputs removed when asked, in case an earlier run
    stopped between publishing and removing); complete ones that differ are redone, saying
    why."""
    todo: list[int] = []
    for index, shard in enumerate(shards):
        if indexed_writer.is_complete(shard.prefix):
            reasons = stale_reasons(shard.prefix, made_from(args, [shard.input]))
            if not reasons:
                print(f"skip {shard.name}: already complete")
                totals.skipped += 1
                if args.remove_inputs and shard.input.exists():
                    remove_input(shard.input)
                continue
            print(f"{'; '.join(reasons)}: redoing {shard.name}")
        elif indexed_writer.idx_path(shard.prefix).exists():
            print(f"redo {shard.name}: its .idx is incomplete or inconsistent")
        todo.append(index)
    return todo


def _progress_bar(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1000,
        desc="tokenize",
        mininterval=0.5 if sys.stderr.isatty() else 30.0,
        dynamic_ncols=True,
    )


def encode_shards(
    shards: Sequence[Shard], todo: Sequence[int], args: argparse.Namespace, totals: Totals
) -> None:
    spec = tokenizer_spec(args)
    global _INHERITED
    tokenizer = load_tokenizer(spec)
    _INHERITED = tokenizer
    print(f"tokenizer: {tokenizer.describe()}")
    options = EncodeOptions(
        args.text_key,
        indexed_writer.token_dtype(tokenizer.vocab_size),
        not args.no_append_eod,
        args.split_sentences,
    )
    units: list[WorkUnit] = []
    for index in todo:
        shutil.rmtree(shards[index].parts_dir, ignore_errors=True)  # leftovers of a failed run
        shards[index].parts_dir.mkdir(parents=True)
        units.extend(plan_units(index, shards[index], args.workers))
    # Biggest first: the last units to start are small, so workers finish close together.
    order = sorted(range(len(units)), key=lambda k: -units[k].size)
    assembler = ShardAssembler(shards, units, args, totals)
    state = _WorkerState(units, shards, spec, options)
    pool = WorkerPool(min(args.workers, len(units)), state)
    try:
        pool.submit_all(order)
        _collect(pool, assembler, units, totals)
    finally:
        pool.close()
        for index in todo:  # partial outputs of shards that did not finish
            shutil.rmtree(shards[index].parts_dir, ignore_errors=True)
        _INHERITED = None


def _collect(
    pool: WorkerPool, assembler: ShardAssembler, units: Sequence[WorkUnit], totals: Totals
) -> None:
    bar = _progress_bar(sum(unit.size for unit in units))
    started = time.perf_counter()
    documents = 0
    remaining = len(units)
    try:
        for message in pool.messages():
            kind = message[0]
            if kind == "progress":
                totals.input_bytes += message[1]
                documents += message[2]
                bar.set_postfix_str(
                    f"{documents / max(time.perf_counter() - started, 1e-9):,.0f} docs/s",
                    refresh=False,
                )
                bar.update(message[1])
            elif kind == "done":
                assembler.add(message[2])
                remaining -= 1
                if remaining == 0:
                    return
            elif kind == "unreadable":
                unit = units[message[1]]
                where = unit.path or f"one of {len(unit.files)} text files"
                raise DataPrepError(
                    f"{where} cannot be read to its end ({message[2]}): it is truncated or "
                    "corrupt. Replace it (download or copy it again) and re-run: complete shards "
                    "are kept"
                )
            else:
                unit = units[message[1]]
                where = unit.path or f"{len(unit.files)} text files"
                detail = message[2].strip()
                print(detail, file=sys.stderr)
                raise DataPrepError(f"worker failed on {where}: {detail.splitlines()[-1]}")
    finally:
        bar.close()


def summary(totals: Totals, seconds: float) -> str:
    mb = totals.input_bytes / 1e6
    return (
        f"summary: {totals.documents} documents, {totals.tokens} tokens, {mb:.1f} MB in "
        f"{seconds:.2f} s: {mb / max(seconds, 1e-9):.1f} MB/s, "
        f"{totals.tokens / max(seconds, 1e-9):,.0f} tokens/s, {totals.bad} bad lines, "
        f"{totals.empty} empty documents skipped; shards: {totals.written} written, "
        f"{totals.skipped} already complete"
    )


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    if args.workers < 1:
        raise DataPrepError("--workers must be at least 1")
    if not 0.0 <= args.max_bad_fraction <= 1.0:
        raise DataPrepError("--max-bad-fraction must be between 0 and 1")
    try:
        rank, world_size = shards.rank_and_world_size(rank=args.rank, world_size=args.world_size)
    except ValueError as error:
        raise DataPrepError(str(error)) from None
    all_shards = plan_shards(args)
    mine = shards.share(all_shards, rank, world_size)
    # The host too: which node ran which task is the first question when one task fails.
    host = socket.gethostname()
    print(f"task {rank} of {world_size} on {host}: {len(mine)} of {len(all_shards)} inputs")
    totals = Totals()
    # Complete shards first: their inputs may be gone (--remove-inputs on an earlier run).
    todo = select_work(mine, args, totals)
    check_inputs([mine[index] for index in todo])
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    if todo:
        encode_shards(mine, todo, args, totals)
    print(summary(totals, time.perf_counter() - started))
    if totals.failures:
        print(
            "error: too many bad records; their shards were not written. "
            + " ".join(f"{failure}." for failure in totals.failures)
            + " Fix the inputs or raise --max-bad-fraction, then re-run: complete shards are kept.",
            file=sys.stderr,
        )
        return 1
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's cancel), unwound like Ctrl-C: workers are terminated and partial
    outputs removed; published shards are complete and stay."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated


def main(argv: Sequence[str] | None = None) -> int:
    use_single_thread()
    args = build_parser().parse_args(argv)
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if in_main_thread else None
    try:
        return run(args)
    except (DataPrepError, TokenizerError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as stop:
        terminated = isinstance(stop, Terminated)
        print(f"error: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return 128 + (signal.SIGTERM if terminated else signal.SIGINT)
    finally:
        if in_main_thread:
            # None: the previous handler was not set from Python; the default is then in force.
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


if __name__ == "__main__":
    sys.exit(main())
