"""Write Megatron-Core's mmap indexed dataset format (`<prefix>.bin` + `<prefix>.idx`).

The layout is the one megatron.core.datasets.indexed_dataset reads ("MMIDIDX"):

    .idx: b"MMIDIDX\\x00\\x00", uint64 version 1, uint8 dtype code, uint64 sequence count,
          uint64 document count, int32[sequences] lengths, int64[sequences] byte pointers,
          int64[documents] document indices (sequence index where each document starts, plus
          the sequence count at the end)
    .bin: the token ids of every sequence back to back, in the dtype named by the code

A document is one sequence (GPT data) or several (sentence-split BERT data, where each
sentence is a sequence and the document indices group them): `add_documents` takes either.

Beside them, `<prefix>.meta.json` (fingerprint.record_path) records the dataset's statistics
(token count, largest token id, dtype, .bin size), which a training preflight reads instead of
scanning the .bin, and, for the datasets data preparation publishes, the fingerprint of what
they were made from.

Pure numpy on purpose: job programs start in a fraction of a second and must not pull in
torch or megatron. Every file is written under a temporary name and moved into place with
os.replace only when complete: an old .idx is removed first, then the record, the .bin and
the .idx last are put in place, so a present .idx marks a complete dataset (see
`is_complete`) whose record, when there is one, is its own.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from launcher_scripts.formats import fingerprint

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# megatron.core.datasets.indexed_dataset.DType: the code stored in the header.
DTYPE_CODES: dict[type[np.number], int] = {
    np.uint8: 1,
    np.int8: 2,
    np.int16: 3,
    np.int32: 4,
    np.int64: 5,
    np.float64: 6,
    np.float32: 7,
    np.uint16: 8,
}
_DTYPES_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}
_FIXED_HEADER = struct.Struct("<9sQBQQ")


def token_dtype(vocab_size: int) -> type[np.number]:
    """The token dtype Megatron-Core picks for a vocabulary (DType.optimal_dtype)."""
    return np.uint16 if vocab_size < 65500 else np.int32


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def _tmp(path: Path) -> Path:
    # Same directory, so os.replace stays a rename on one file system.
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@dataclass(frozen=True)
class IndexData:
    """The contents of one .idx file."""

    dtype: type[np.number]
    sequence_lengths: npt.NDArray[np.int32]
    document_indices: npt.NDArray[np.int64]

    @property
    def token_count(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    @property
    def bin_size(self) -> int:
        return self.token_count * np.dtype(self.dtype).itemsize


def write_index(path: Path, index: IndexData) -> None:
    """Write an .idx file (directly at `path`; callers choose the temporary name)."""
    lengths = np.ascontiguousarray(index.sequence_lengths, dtype=np.int32)
    itemsize = np.dtype(index.dtype).itemsize
    pointers = np.zeros(lengths.size, dtype=np.int64)
    if lengths.size > 1:
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= itemsize
    documents = np.ascontiguousarray(index.document_indices, dtype=np.int64)
    with open(path, "wb") as stream:
        stream.write(
            _FIXED_HEADER.pack(
                INDEX_HEADER,
                INDEX_VERSION,
                DTYPE_CODES[index.dtype],
                lengths.size,
                documents.size,
            )
        )
        stream.write(memoryview(lengths))
        stream.write(memoryview(pointers))
        stream.write(memoryview(documents))


@dataclass(frozen=True)
class IndexHeader:
    """The fixed header of an .idx file and where its three arrays lie."""

    dtype: type[np.number]
    sequences: int
    documents: int

    @property
    def lengths_offset(self) -> int:
        return _FIXED_HEADER.size

    @property
    def pointers_offset(self) -> int:
        return self.lengths_offset + self.sequences * 4

    @property
    def documents_offset(self) -> int:
        return self.pointers_offset + self.sequences * 8

    @property
    def file_size(self) -> int:
        return self.documents_offset + self.documents * 8


def read_header(path: str | Path) -> IndexHeader:
    """The header of an .idx file whose size matches it; ValueError otherwise."""
    with open(path, "rb") as stream:
        data = stream.read(_FIXED_HEADER.size)
        size = os.fstat(stream.fileno()).st_size
    if len(data) < _FIXED_HEADER.size:
        raise ValueError(f"{path}: too short for an MMIDIDX index")
    magic, version, code, sequences, documents = _FIXED_HEADER.unpack(data)
    if magic != INDEX_HEADER or version != INDEX_VERSION or code not in _DTYPES_BY_CODE:
        raise ValueError(f"{path}: not an MMIDIDX version 1 index")
    header = IndexHeader(_DTYPES_BY_CODE[code], sequences, documents)
    if size != header.file_size:
        raise ValueError(f"{path}: {size} bytes, expected {header.file_size}")
    return header


def _mapped(path: str | Path, dtype: type, offset: int, count: int) -> npt.NDArray[Any]:
    """`count` items at `offset` of a file, memory-mapped: an index may be tens of GB."""
    if count == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))


def read_index(path: str | Path) -> IndexData:
    """Read an .idx file; ValueError when it is not a complete MMIDIDX index."""
    header = read_header(path)
    lengths = np.array(_mapped(path, np.int32, header.lengths_offset, header.sequences))
    documents = _mapped(path, np.int64, header.documents_offset, header.documents)
    return IndexData(header.dtype, lengths, np.array(documents))


def is_complete(prefix: str | Path) -> bool:
    """Whether `prefix` is a finished dataset: a valid .idx whose .bin has the expected size.

    The expected size is the last sequence's pointer plus its length, so even an index of
    billions of sequences is checked by reading a few bytes of it.
    """
    try:
        path = idx_path(prefix)
        header = read_header(path)
        expected = 0
        if header.sequences:
            last = header.sequences - 1
            pointer = _mapped(path, np.int64, header.pointers_offset + last * 8, 1)[0]
            length = _mapped(path, np.int32, header.lengths_offset + last * 4, 1)[0]
            expected = int(pointer) + int(length) * np.dtype(header.dtype).itemsize
        return bin_path(prefix).stat().st_size == expected
    except (OSError, ValueError):
        return False


def read_stats(prefix: str | Path) -> dict[str, Any] | None:
    """The statistics recorded with a dataset; None when there are none, or when they are not
    of the .bin that is there now."""
    record = fingerprint.read_record(prefix)
    try:
        if record is None or int(record["bin_size"]) != bin_path(prefix).stat().st_size:
            return None
    except (OSError, KeyError, TypeError, ValueError):
        return None
    return record


def publish_files(
    tmp_bin: Path, tmp_idx: Path, prefix: str | Path, record: dict[str, Any] | None
) -> None:
    """Move a finished .bin/.idx pair into place at `prefix` with its record.

    The old .idx goes first and the new one last: its presence is what marks the dataset
    complete, so a crash in between leaves an incomplete dataset, never a complete one beside
    another's record.
    """
    idx_path(prefix).unlink(missing_ok=True)
    if record is None:
        fingerprint.remove_record(prefix)
    else:
        fingerprint.write_record(prefix, record)
    os.replace(tmp_bin, bin_path(prefix))
    os.replace(tmp_idx, idx_path(prefix))


def dataset_record(
    dtype: type[np.number],
    tokens: int,
    max_token_id: int | None,
    made_from: fingerprint.Fingerprint | None = None,
) -> dict[str, Any]:
    """A dataset's record: its statistics and, when given, what it was made from."""
    record: dict[str, Any] = {
        "dtype": np.dtype(dtype).name,
        "tokens": tokens,
        "bin_size": tokens * np.dtype(dtype).itemsize,
        "max_token_id": max_token_id,
    }
    if made_from is not None:
        record["fingerprint"] = made_from
    return record


class IndexedDatasetWriter:
    """Stream documents into a new dataset at `prefix`.

    Tokens go to disk as they arrive; only the sequence lengths and document ends stay in
    memory. Use as a context manager: leaving it by an exception removes the temporary files.
    """

    def __init__(self, prefix: str | Path, dtype: type[np.number]) -> None:
        if dtype not in DTYPE_CODES:
            raise ValueError(f"unsupported token dtype {dtype}")
        self.prefix = Path(prefix)
        self.dtype = dtype
        self._tmp_bin = _tmp(bin_path(prefix))
        self._tmp_idx = _tmp(idx_path(prefix))
        self._lengths: list[npt.NDArray[np.int32]] = []
        # The sequence count at the end of each document: megatron's document_indices[1:].
        self._document_ends: list[npt.NDArray[np.int64]] = []
        self._stream: BinaryIO | None = open(self._tmp_bin, "wb")  # noqa: SIM115
        self.documents = 0
        self.sequences = 0
        self.tokens = 0
        self.max_token_id: int | None = None
        self._open_sequences = 0  # sequences added since the last document ended

    def add_sequences(
        self, tokens: npt.NDArray[np.number], lengths: npt.NDArray[np.integer]
    ) -> None:
        """Append sequences (one flat token array and each sequence's length) to the
        document being built; `end_document` closes it."""
        assert self._stream is not None, "writer already closed"
        if tokens.dtype != self.dtype:
            tokens = tokens.astype(self.dtype)
        if int(lengths.sum()) != tokens.size:
            raise ValueError(f"lengths add up to {int(lengths.sum())}, tokens are {tokens.size}")
        self._stream.write(memoryview(np.ascontiguousarray(tokens)))
        if tokens.size:
            # Recorded so that a training preflight need not scan the .bin for it.
            largest = int(tokens.max())
            self.max_token_id = max(largest, self.max_token_id or 0)
        self._lengths.append(np.asarray(lengths, dtype=np.int32))
        self.sequences += lengths.size
        self._open_sequences += lengths.size
        self.tokens += tokens.size

    def end_document(self) -> None:
        """End the current document after the sequences added so far."""
        self._document_ends.append(np.array([self.sequences], dtype=np.int64))
        self.documents += 1
        self._open_sequences = 0

    def add_documents(
        self,
        tokens: npt.NDArray[np.number],
        lengths: npt.NDArray[np.integer],
        sequences_per_document: npt.NDArray[np.integer] | None = None,
    ) -> None:
        """Append whole documents given as one flat token array and each sequence's length.

        Without `sequences_per_document` every sequence is a document of its own; with it,
        document k is the next sequences_per_document[k] sequences.
        """
        if self._open_sequences:
            raise ValueError("a document is still open: call end_document first")
        first = self.sequences
        self.add_sequences(tokens, lengths)
        self._open_sequences = 0
        if sequences_per_document is None:
            ends = np.arange(first + 1, self.sequences + 1, dtype=np.int64)
        else:
            counts = np.asarray(sequences_per_document, dtype=np.int64)
            if int(counts.sum()) != lengths.size or (counts.size and counts.min() < 0):
                raise ValueError(
                    f"sequences per document add up to {int(counts.sum())}, "
                    f"sequences are {lengths.size}"
                )
            ends = first + np.cumsum(counts, dtype=np.int64)
        self._document_ends.append(ends)
        self.documents += ends.size

    def finalize(self, made_from: fingerprint.Fingerprint | None = None) -> None:
        """Write the index and move both files into place, with the dataset's record (and
        `made_from`, the fingerprint of its inputs, in it)."""
        assert self._stream is not None, "writer already closed"
        if self._open_sequences:
            self.abort()
            raise ValueError(f"{self.prefix}: the last document was not ended (end_document)")
        self._stream.close()
        self._stream = None
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        documents = np.concatenate([np.zeros(1, np.int64), *self._document_ends])
        write_index(self._tmp_idx, IndexData(self.dtype, lengths, documents))
        record = dataset_record(self.dtype, self.tokens, self.max_token_id, made_from)
        publish_files(self._tmp_bin, self._tmp_idx, self.prefix, record)

    def abort(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        for path in (self._tmp_bin, self._tmp_idx):
            path.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self.abort()
        elif self._stream is not None:
            self.finalize()


def write_dataset(
    prefix: str | Path, documents: Sequence[Sequence[int]], dtype: type[np.number]
) -> None:
    """Write a whole dataset from in-memory documents (one sequence per document)."""
    lengths = np.fromiter((len(doc) for doc in documents), dtype=np.int64, count=len(documents))
    flat = np.fromiter(
        (token for doc in documents for token in doc), dtype=dtype, count=int(lengths.sum())
    )
    with IndexedDatasetWriter(prefix, dtype) as writer:
        writer.add_documents(flat, lengths)


# Sequences per slice of an index when merging: bounded memory whatever the index size.
MERGE_CHUNK = 1 << 22


def merge_datasets(
    parts: Sequence[str | Path],
    prefix: str | Path,
    made_from: fingerprint.Fingerprint | None = None,
) -> IndexData:
    """Concatenate the datasets `parts` (in order) into a new dataset at `prefix`, recorded
    with `made_from`.

    Used to combine per-worker partial outputs, and the per-file datasets of a language. The
    indices are streamed slice by slice, so memory stays bounded even for billions of
    sequences. The parts are left in place; the caller removes them once the merged dataset
    is published. Returns the merged index, memory-mapped.
    """
    if not parts:
        raise ValueError("nothing to merge")
    headers = [read_header(idx_path(part)) for part in parts]
    for part, header in zip(parts, headers, strict=True):
        if header.documents < 1:  # megatron's document indices always start with a 0
            raise ValueError(f"{idx_path(part)}: no document indices")
    dtypes = {header.dtype for header in headers}
    if len(dtypes) != 1:
        raise ValueError(f"parts have different token dtypes: {sorted(map(str, dtypes))}")
    dtype = headers[0].dtype
    merged = IndexHeader(
        dtype,
        sum(header.sequences for header in headers),
        sum(header.documents - 1 for header in headers) + 1,
    )
    tmp_bin, tmp_idx = _tmp(bin_path(prefix)), _tmp(idx_path(prefix))
    try:
        _concatenate_files([bin_path(part) for part in parts], tmp_bin)
        with open(tmp_idx, "wb") as out:
            _write_merged_index(out, parts, headers, merged)
        tokens = _merged_token_count(parts, headers)
        if tmp_bin.stat().st_size != tokens * np.dtype(dtype).itemsize:
            raise ValueError(f"merged .bin of {prefix} does not match its index")
        record = dataset_record(dtype, tokens, _merged_max_token_id(parts), made_from)
        publish_files(tmp_bin, tmp_idx, prefix, record)
    except BaseException:
        tmp_bin.unlink(missing_ok=True)
        tmp_idx.unlink(missing_ok=True)
        raise
    path = idx_path(prefix)
    return IndexData(
        dtype,
        _mapped(path, np.int32, merged.lengths_offset, merged.sequences),
        _mapped(path, np.int64, merged.documents_offset, merged.documents),
    )


def _merged_max_token_id(parts: Sequence[str | Path]) -> int | None:
    """The largest token id of all parts, from their records; None when a part has none."""
    largest: int | None = None
    for part in parts:
        stats = read_stats(part)
        if stats is None:
            return None
        if stats.get("max_token_id") is not None:
            largest = max(largest or 0, int(stats["max_token_id"]))
    return largest


def _slices(count: int) -> Iterator[tuple[int, int]]:
    for start in range(0, count, MERGE_CHUNK):
        yield start, min(start + MERGE_CHUNK, count)


def _part_lengths(part: str | Path, header: IndexHeader) -> npt.NDArray[np.int32]:
    return _mapped(idx_path(part), np.int32, header.lengths_offset, header.sequences)


def _merged_token_count(parts: Sequence[str | Path], headers: Sequence[IndexHeader]) -> int:
    return sum(
        int(_part_lengths(part, header)[start:end].sum(dtype=np.int64))
        for part, header in zip(parts, headers, strict=True)
        for start, end in _slices(header.sequences)
    )


def _write_merged_index(
    out: BinaryIO,
    parts: Sequence[str | Path],
    headers: Sequence[IndexHeader],
    merged: IndexHeader,
) -> None:
    """The merged .idx, byte for byte what write_index writes for the concatenated arrays."""
    out.write(
        _FIXED_HEADER.pack(
            INDEX_HEADER, INDEX_VERSION, DTYPE_CODES[merged.dtype], merged.sequences,
            merged.documents,
        )
    )  # fmt: skip
    for part, header in zip(parts, headers, strict=True):
        lengths = _part_lengths(part, header)
        for start, end in _slices(header.sequences):
            out.write(memoryview(np.ascontiguousarray(lengths[start:end])))
    itemsize = np.dtype(merged.dtype).itemsize
    position = 0  # bytes of .bin before the current sequence
    for part, header in zip(parts, headers, strict=True):
        lengths = _part_lengths(part, header)
        for start, end in _slices(header.sequences):
            sizes = lengths[start:end].astype(np.int64) * itemsize
            pointers = np.empty(sizes.size, dtype=np.int64)
            pointers[0:1] = position
            np.cumsum(sizes[:-1], out=pointers[1:])
            pointers[1:] += position
            position += int(sizes.sum())
            out.write(memoryview(pointers))
    out.write(memoryview(np.zeros(1, dtype=np.int64)))
    offset = 0  # sequences of the parts before this one
    for part, header in zip(parts, headers, strict=True):
        # Each part's document indices start at 0 and end at its sequence count; shift by
        # the sequences before it and drop the leading 0 (megatron's add_index does the same).
        documents = _mapped(idx_path(part), np.int64, header.documents_offset, header.documents)
        for start, end in _slices(header.documents - 1):
            out.write(memoryview(documents[start + 1 : end + 1] + offset))
        offset += header.sequences


def _concatenate_files(sources: Sequence[Path], target: Path) -> None:
    with open(target, "wb") as out:
        for source in sources:
            with open(source, "rb") as src:
                _copy_all(src, out)


def _copy_all(src: BinaryIO, out: BinaryIO) -> None:
    size = os.fstat(src.fileno()).st_size
    copied = 0
    try:
        # In-kernel copy (and a reflink on file systems that have them): no user-space pass.
        while copied < size:
            step = os.copy_file_range(src.fileno(), out.fileno(), size - copied)
            if step == 0:
                break
            copied += step
    except (AttributeError, OSError):
        pass
    if copied < size:
        src.seek(copied)
        out.seek(0, os.SEEK_END)
        shutil.copyfileobj(src, out, 16 << 20)
