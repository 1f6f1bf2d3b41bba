"""Iterate the documents of a dataset: JSON lines, JSON arrays, gzip, or text directories.

Supported inputs:
  * `.jsonl` / `.json`: one JSON object per line, the text under a configurable key; a `.json`
    file whose first non-blank byte is `[` is read as one JSON array of objects instead.
  * `.jsonl.gz` / `.json.gz`: the same, gzip-compressed.
  * a directory: every regular file below it (recursively, in sorted path order) is one
    UTF-8 document.

Bad records (not JSON, not an object, text missing or not a string, a text file that is not
UTF-8) never stop the read: they are counted in `ReadStats` with where they are, so the job
can report them and decide against its --max-bad-fraction. Blank lines are not records and
are neither counted nor reported (a trailing blank line is common in JSONL writers).

Documents come in batches (lists of str) because the consumers encode in batches; a worker
can read just a byte range of an uncompressed JSONL file (`iter_jsonl_range`), so several
processes split one big file without sending the text between processes.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

try:
    import orjson

    _loads: Callable[[bytes], Any] = orjson.loads
    _JSON_ERRORS: tuple[type[Exception], ...] = (orjson.JSONDecodeError,)
except ImportError:  # pragma: no cover - orjson is a declared dependency; stdlib is the fallback
    _loads = json.loads
    _JSON_ERRORS = (ValueError,)

JSON_SUFFIXES = (".jsonl", ".json")
GZIP_SUFFIX = ".gz"
MAX_REPORTED_BAD = 10


@dataclass(frozen=True)
class BadRecord:
    """One unusable record: `line` is 1-based within its file (0: the file as a whole)."""

    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line else self.path
        return f"{where}: {self.reason}"


@dataclass
class ReadStats:
    """Counts for one read: records (non-blank lines, array elements or files), the bad
    ones with the first few of them, and the physical lines read (to renumber a byte range).
    """

    records: int = 0
    bad: int = 0
    bad_examples: list[BadRecord] = field(default_factory=list)
    lines: int = 0
    bytes_read: int = 0

    def add_bad(self, path: str, line: int, reason: str) -> None:
        self.bad += 1
        if len(self.bad_examples) < MAX_REPORTED_BAD:
            self.bad_examples.append(BadRecord(path, line, reason))

    def merge(self, other: ReadStats, line_offset: int = 0) -> None:
        """Add the counts of a read that followed this one; its line numbers move by
        `line_offset` (the lines of the byte ranges before it)."""
        self.records += other.records
        self.bad += other.bad
        self.lines += other.lines
        self.bytes_read += other.bytes_read
        room = MAX_REPORTED_BAD - len(self.bad_examples)
        for example in other.bad_examples[: max(room, 0)]:
            line = example.line + line_offset if example.line else 0
            self.bad_examples.append(BadRecord(example.path, line, example.reason))


def is_json_input(path: str | Path) -> bool:
    name = Path(path).name.lower()
    return name.removesuffix(GZIP_SUFFIX).endswith(JSON_SUFFIXES)


def is_gzip(path: str | Path) -> bool:
    return str(path).lower().endswith(GZIP_SUFFIX)


def dataset_stem(path: str | Path) -> str:
    """The input's name without .gz and .json/.jsonl suffixes (a directory keeps its name)."""
    path = Path(path)
    name = path.name or path.resolve().name
    if path.is_dir():
        return name
    for suffix in (GZIP_SUFFIX, ".jsonl", ".json"):
        if name.lower().endswith(suffix):
            name = name[: -len(suffix)]
    return name


def text_files(directory: str | Path) -> list[Path]:
    """The regular files below `directory`, recursively, in sorted path order.

    Hidden files and folders (names starting with '.') are left out: they are editor and
    version-control litter, not documents.
    """
    found: list[Path] = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = [name for name in dirs if not name.startswith(".")]
        found.extend(Path(root, name) for name in files if not name.startswith("."))
    return sorted(found)


def json_shards(directory: str | Path) -> list[Path] | None:
    """The files of a folder of JSON/JSONL shards (as data_curation writes), read as one
    dataset in name order; None for a folder of text files (one document each)."""
    files = text_files(directory)
    return files if files and all(is_json_input(f) for f in files) else None


def starts_with_array(stream: BinaryIO) -> bool:
    """Whether a JSON stream is one array (first non-blank byte '['); rewinds the stream."""
    head = stream.read(4096)
    stream.seek(0)
    return head.lstrip(b" \t\r\n\xef\xbb\xbf").startswith(b"[")


def line_start_at_or_after(stream: BinaryIO, offset: int) -> int:
    """The first line start at or after `offset` (the file size when there is none)."""
    size = os.fstat(stream.fileno()).st_size
    if offset <= 0:
        return 0
    if offset >= size:
        return size
    # A line starts at `offset` exactly when the byte before it is a newline; readline from
    # there consumes up to and including the next newline, landing on the next line start.
    stream.seek(offset - 1)
    stream.readline()
    return stream.tell()


def _iter_line_chunks(
    stream: BinaryIO, limit: int | None, chunk_bytes: int
) -> Iterator[tuple[bytearray, int]]:
    """(buffer, end) pairs: buffer[:end] holds whole lines, about `chunk_bytes` of them (the
    last chunk may lack its final newline at end of input).

    The input is read straight into one reused buffer and parsed in place: the bytes are
    copied once, by the read, and never split into per-line objects. A chunk is therefore
    valid only until the next one is asked for.
    """
    buffer = bytearray(max(chunk_bytes, 1))
    filled = 0  # bytes held: the unfinished line of the previous chunk, then new input
    remaining = limit
    while True:
        want = len(buffer) - filled
        if remaining is not None:
            want = min(want, remaining)
        got = stream.readinto(memoryview(buffer)[filled : filled + want]) if want else 0
        if not got:
            if filled:
                yield buffer, filled
            return
        if remaining is not None:
            remaining -= got
        filled += got
        cut = buffer.rfind(b"\n", 0, filled) + 1
        if cut == 0:
            if filled == len(buffer):  # one line longer than the buffer: make room
                buffer = buffer + bytes(len(buffer))
            continue
        yield buffer, cut
        tail = filled - cut
        buffer[:tail] = buffer[cut:filled]
        filled = tail


def _parse_chunk(
    buffer: bytearray, end: int, first_line: int, path: str, text_key: str, stats: ReadStats
) -> tuple[list[str], int]:
    """The texts of the JSON lines in buffer[:end] and the number of lines; bad ones go to
    `stats`. The hot loop of reading: each line is parsed from a zero-copy view."""
    texts: list[str] = []
    append = texts.append
    loads = _loads
    view = memoryview(buffer)
    find = buffer.find
    start = 0
    number = first_line - 1
    records = 0
    while start < end:
        number += 1
        stop = find(b"\n", start, end)
        if stop < 0:
            stop = end
        line = view[start:stop]
        start = stop + 1
        try:
            obj = loads(line)
        except _JSON_ERRORS:
            if bytes(line).strip():
                records += 1
                stats.add_bad(path, number, "not valid JSON")
            continue
        records += 1
        if type(obj) is dict:
            text = obj.get(text_key)
            if type(text) is str:
                append(text)
                continue
            reason = f"key {text_key!r} missing" if text is None else f"{text_key!r} not a string"
        else:
            reason = "not a JSON object"
        stats.add_bad(path, number, reason)
    stats.records += records
    return texts, number - first_line + 1


def iter_jsonl_stream(
    stream: BinaryIO,
    path: str,
    text_key: str,
    stats: ReadStats,
    limit: int | None = None,
    batch_bytes: int = 1 << 20,
) -> Iterator[list[str]]:
    """Batches of texts (about `batch_bytes` of input each) from JSON lines read from
    `stream` (at most `limit` bytes)."""
    line = 1
    for buffer, end in _iter_line_chunks(stream, limit, batch_bytes):
        texts, lines = _parse_chunk(buffer, end, line, path, text_key, stats)
        line += lines
        stats.lines += lines
        stats.bytes_read += end
        if texts:
            yield texts


def iter_jsonl_range(
    path: str | Path,
    start: int,
    end: int,
    text_key: str,
    stats: ReadStats,
    batch_bytes: int = 1 << 20,
) -> Iterator[list[str]]:
    """Batches of texts from the lines of a JSONL file whose first byte is in [start, end).

    That is: from the first full line at or after `start` through the line that crosses
    `end`, so ranges that tile a file read every line exactly once. Line numbers in `stats`
    count from the range's first line; `ReadStats.merge` renumbers them.
    """
    with open(path, "rb", buffering=0) as stream:
        first = line_start_at_or_after(stream, start)
        last = line_start_at_or_after(stream, end)
        stream.seek(first)
        yield from iter_jsonl_stream(stream, str(path), text_key, stats, last - first, batch_bytes)


def iter_json_array(
    stream: BinaryIO, path: str, text_key: str, stats: ReadStats, batch_bytes: int
) -> Iterator[list[str]]:
    """Batches of texts from a JSON array of objects; bad elements count by element number."""
    try:
        items = _loads(stream.read())
    except _JSON_ERRORS as error:
        stats.records += 1
        stats.add_bad(path, 0, f"not a valid JSON array ({error})")
        return
    if not isinstance(items, list):
        stats.records += 1
        stats.add_bad(path, 0, "not a JSON array")
        return

    def documents() -> Iterator[tuple[str, int]]:
        for number, item in enumerate(items, 1):
            stats.records += 1
            text = item.get(text_key) if isinstance(item, dict) else None
            if not isinstance(text, str):
                stats.add_bad(path, number, f"array element has no string {text_key!r}")
                continue
            yield text, len(text)

    yield from _batched(documents(), batch_bytes)


def _batched(documents: Iterable[tuple[str, int]], batch_bytes: int) -> Iterator[list[str]]:
    """Group (text, size) pairs into lists of about `batch_bytes` each."""
    texts: list[str] = []
    size = 0
    for text, text_size in documents:
        texts.append(text)
        size += text_size
        if size >= batch_bytes:
            yield texts
            texts, size = [], 0
    if texts:
        yield texts


def open_input(path: str | Path) -> BinaryIO:
    if is_gzip(path):
        # A buffered reader over GzipFile: large reads decompress in big steps.
        return io.BufferedReader(gzip.GzipFile(path, "rb"), 1 << 20)  # type: ignore[arg-type]
    return open(path, "rb")  # noqa: SIM115


def iter_json_file(
    path: str | Path, text_key: str, stats: ReadStats, batch_bytes: int = 1 << 20
) -> Iterator[list[str]]:
    """Batches of texts from a whole .json/.jsonl(.gz) file."""
    with open_input(path) as stream:
        if starts_with_array(stream):
            yield from iter_json_array(stream, str(path), text_key, stats, batch_bytes)
        else:
            yield from iter_jsonl_stream(stream, str(path), text_key, stats, None, batch_bytes)


def iter_text_files(
    files: Iterable[str | Path], stats: ReadStats, batch_bytes: int = 1 << 20
) -> Iterator[list[str]]:
    """Batches of documents, one per text file; files that are not UTF-8 are bad records."""

    def documents() -> Iterator[tuple[str, int]]:
        for file in files:
            stats.records += 1
            data = Path(file).read_bytes()
            stats.bytes_read += len(data)
            try:
                yield data.decode("utf-8"), len(data)
            except UnicodeDecodeError as error:
                stats.add_bad(str(file), 0, f"not UTF-8 text (byte {error.start})")

    yield from _batched(documents(), batch_bytes)


def iter_document_batches(
    path: str | Path, text_key: str, stats: ReadStats, batch_bytes: int = 1 << 20
) -> Iterator[list[str]]:
    """Batches of document texts from any supported input."""
    if Path(path).is_dir():
        shards = json_shards(path)
        if shards is not None:
            return (
                b for shard in shards for b in iter_json_file(shard, text_key, stats, batch_bytes)
            )
        return iter_text_files(text_files(path), stats, batch_bytes)
    if is_json_input(path):
        return iter_json_file(path, text_key, stats, batch_bytes)
    raise ValueError(
        f"unsupported input {path}: give .json, .jsonl, .json.gz, .jsonl.gz or a directory"
    )


def iter_documents(path: str | Path, text_key: str, stats: ReadStats) -> Iterator[str]:
    """Every document text of one input, in order."""
    for batch in iter_document_batches(path, text_key, stats):
        yield from batch


def report_bad(stats: ReadStats, label: str) -> list[str]:
    """Human-readable lines about the bad records of one input (empty when there were none)."""
    if not stats.bad:
        return []
    lines = [f"{label}: {stats.bad} bad of {stats.records} records"]
    lines.extend(f"  {example}" for example in stats.bad_examples)
    hidden = stats.bad - len(stats.bad_examples)
    if hidden > 0:
        lines.append(f"  ... and {hidden} more bad records")
    return lines


def sentence_iterator(
    paths: Iterable[str | Path], text_key: str = "text", stats: ReadStats | None = None
) -> Iterator[str]:
    """Non-blank lines of every document of the datasets in `paths` (for tokenizer training:
    SentencePiece takes sentences, and drops ones longer than its max_sentence_length).
    """
    stats = ReadStats() if stats is None else stats
    for path in paths:
        for text in iter_documents(path, text_key, stats):
            for line in text.splitlines():
                if line.strip():
                    yield line
