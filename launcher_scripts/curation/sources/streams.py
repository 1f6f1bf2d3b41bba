"""Opening a possibly compressed input as text lines, with damage counted, not raised: a
truncated or corrupt .gz/.bz2/.zst stops the file where it breaks, and a line that is not
UTF-8 is skipped."""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import lzma
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from launcher_scripts.curation.sources import ReadStats

DAMAGE = (EOFError, OSError, zlib.error, lzma.LZMAError)


def open_binary(path: str) -> IO[bytes]:
    name = Path(path).name
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".bz2"):
        return bz2.open(path, "rb")
    if name.endswith(".xz"):
        return lzma.open(path, "rb")
    if name.endswith(".zst"):
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)  # noqa: SIM115
    return open(path, "rb")  # noqa: SIM115


@contextlib.contextmanager
def open_text(path: str, stats: ReadStats) -> Iterator[Iterator[str]]:
    """The file's lines, decoded as UTF-8; a line that is not UTF-8 is counted and skipped."""
    stream = open_binary(path)
    try:
        yield _lines(stream, path, stats)
    finally:
        stream.close()


def _lines(stream: IO[bytes], path: str, stats: ReadStats) -> Iterator[str]:
    name = Path(path).name
    reader = io.BufferedReader(stream) if not isinstance(stream, io.BufferedIOBase) else stream
    number = 0
    while True:
        try:
            raw = reader.readline()
        except DAMAGE as error:
            stats.add_bad("truncated_or_corrupt_file", f"{name} after line {number} ({error})")
            return
        if not raw:
            return
        number += 1
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            stats.records += 1
            stats.add_bad("not_utf8", f"{name}:{number}")
            continue
        yield line
