"""Files and folders written whole: a reader sees the old one or the new one, never one half
written."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replaced_directory(target: Path) -> Iterator[Path]:
    """An empty folder beside `target` to fill; when the block ends without an error it
    replaces `target`, made readable to all (as the umask allows). An error in the block
    leaves `target` as it was.

    The old folder is renamed aside and removed only once the new one is in place: a crash
    between the two renames leaves it whole, as `.<name>-old-*`.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    old: Path | None = None
    try:
        yield partial
        make_readable(partial)
        if target.exists():
            old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-old-"))
            os.replace(target, old)
        try:
            os.replace(partial, target)
        except BaseException:
            if old is not None:
                os.replace(old, target)
                old = None
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def make_readable(root: Path) -> None:
    """mkdtemp and some writers (safetensors) create owner-only files; outputs are shared.
    Hard-linked files keep their mode: it is their source's too."""
    umask = os.umask(0)
    os.umask(umask)
    for directory, _dirs, files in os.walk(root):
        Path(directory).chmod(0o777 & ~umask)
        for file in files:
            path = Path(directory) / file
            if path.stat().st_nlink == 1:
                path.chmod(0o666 & ~umask)


@contextlib.contextmanager
def replaced_file(path: Path) -> Iterator[Path]:
    """A hidden temporary name beside `path`, with its suffix (numpy and matplotlib choose the
    format by it), to write; renamed to `path` when the block ends without an error, removed
    when it does not."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")
    try:
        yield temporary
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary name beside `path`, then rename."""
    with replaced_file(path) as temporary:
        temporary.write_text(text, encoding="utf-8")
