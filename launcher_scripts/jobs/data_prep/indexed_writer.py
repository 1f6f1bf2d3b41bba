"""Write Megatron-Core's mmap indexed dataset format (`<prefix>.bin` + `<prefix>.idx`).

The layout is the one megatron.core.datasets.indexed_dataset reads ("MMIDIDX"):

    .idx: b"MMIDIDX\\x00\\x00", uint64 version 1, uint8 dtype code, uint64 sequence count,
          uint64 document count, int32[sequences] lengths, int64[sequences] byte pointers,
          int64[documents] document indices (sequence index where each document starts, plus
          the sequence count at the end)
    .bin: the token ids of every sequence back to back, in the dtype named by the code

Pure numpy on purpose: job programs start in a fraction of a second and must not pull in
torch or megatron. Every file is written under a temporary name and moved into place with
os.replace only when complete, the .bin first and the .idx last, so a present .idx marks a
complete dataset (see `is_complete`).
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import numpy.typing as npt

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


def read_index(path: str | Path) -> IndexData:
    """Read an .idx file; ValueError when it is not a complete MMIDIDX index."""
    data = Path(path).read_bytes()
    if len(data) < _FIXED_HEADER.size:
        raise ValueError(f"{path}: too short for an MMIDIDX index")
    header, version, code, sequences, documents = _FIXED_HEADER.unpack_from(data)
    if header != INDEX_HEADER or version != INDEX_VERSION or code not in _DTYPES_BY_CODE:
        raise ValueError(f"{path}: not an MMIDIDX version 1 index")
    expected = _FIXED_HEADER.size + sequences * (4 + 8) + documents * 8
    if len(data) != expected:
        raise ValueError(f"{path}: {len(data)} bytes, expected {expected}")
    offset = _FIXED_HEADER.size
    lengths = np.frombuffer(data, dtype=np.int32, count=sequences, offset=offset)
    offset += sequences * 12  # lengths, then pointers (recomputed on write, so skipped)
    document_indices = np.frombuffer(data, dtype=np.int64, count=documents, offset=offset)
    return IndexData(_DTYPES_BY_CODE[code], lengths, document_indices)


def is_complete(prefix: str | Path) -> bool:
    """Whether `prefix` is a finished dataset: a valid .idx whose .bin has the expected size."""
    try:
        index = read_index(idx_path(prefix))
        return bin_path(prefix).stat().st_size == index.bin_size
    except (OSError, ValueError):
        return False


def _publish(tmp_bin: Path, tmp_idx: Path, prefix: str | Path) -> None:
    # The .idx goes last: its presence is what marks the dataset complete.
    os.replace(tmp_bin, bin_path(prefix))
    os.replace(tmp_idx, idx_path(prefix))


class IndexedDatasetWriter:
    """Stream documents (one sequence each) into a new dataset at `prefix`.

    Tokens go to disk as they arrive; only the per-document lengths stay in memory.
    Use as a context manager: leaving it by an exception removes the temporary files.
    """

    def __init__(self, prefix: str | Path, dtype: type[np.number]) -> None:
        if dtype not in DTYPE_CODES:
            raise ValueError(f"unsupported token dtype {dtype}")
        self.prefix = Path(prefix)
        self.dtype = dtype
        self._tmp_bin = _tmp(bin_path(prefix))
        self._tmp_idx = _tmp(idx_path(prefix))
        self._lengths: list[npt.NDArray[np.int32]] = []
        self._stream: BinaryIO | None = open(self._tmp_bin, "wb")  # noqa: SIM115
        self.documents = 0
        self.tokens = 0

    def add_documents(
        self, tokens: npt.NDArray[np.number], lengths: npt.NDArray[np.integer]
    ) -> None:
        """Append documents given as one flat token array and the length of each document."""
        assert self._stream is not None, "writer already closed"
        if tokens.dtype != self.dtype:
            tokens = tokens.astype(self.dtype)
        if int(lengths.sum()) != tokens.size:
            raise ValueError(f"lengths add up to {int(lengths.sum())}, tokens are {tokens.size}")
        self._stream.write(memoryview(np.ascontiguousarray(tokens)))
        self._lengths.append(np.asarray(lengths, dtype=np.int32))
        self.documents += lengths.size
        self.tokens += tokens.size

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        assert self._stream is not None, "writer already closed"
        self._stream.close()
        self._stream = None
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        documents = np.arange(lengths.size + 1, dtype=np.int64)
        write_index(self._tmp_idx, IndexData(self.dtype, lengths, documents))
        _publish(self._tmp_bin, self._tmp_idx, self.prefix)

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


def merge_datasets(parts: Sequence[str | Path], prefix: str | Path) -> IndexData:
    """Concatenate the datasets `parts` (in order) into a new dataset at `prefix`.

    Used to combine per-worker partial outputs. The parts are left in place; the caller
    removes them once the merged dataset is published.
    """
    if not parts:
        raise ValueError("nothing to merge")
    indices = [read_index(idx_path(part)) for part in parts]
    dtypes = {index.dtype for index in indices}
    if len(dtypes) != 1:
        raise ValueError(f"parts have different token dtypes: {sorted(map(str, dtypes))}")
    tmp_bin, tmp_idx = _tmp(bin_path(prefix)), _tmp(idx_path(prefix))
    try:
        _concatenate_files([bin_path(part) for part in parts], tmp_bin)
        merged = _merge_indices(indices)
        if tmp_bin.stat().st_size != merged.bin_size:
            raise ValueError(f"merged .bin of {prefix} does not match its index")
        write_index(tmp_idx, merged)
        _publish(tmp_bin, tmp_idx, prefix)
    except BaseException:
        tmp_bin.unlink(missing_ok=True)
        tmp_idx.unlink(missing_ok=True)
        raise
    return merged


def _merge_indices(indices: Sequence[IndexData]) -> IndexData:
    lengths = np.concatenate([index.sequence_lengths for index in indices])
    documents = [np.zeros(1, dtype=np.int64)]
    offset = 0
    for index in indices:
        # Each part's document indices start at 0 and end at its sequence count; shift by
        # the sequences before it and drop the leading 0 (megatron's add_index does the same).
        documents.append(index.document_indices[1:] + offset)
        offset += index.sequence_lengths.size
    return IndexData(indices[0].dtype, lengths, np.concatenate(documents))


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
