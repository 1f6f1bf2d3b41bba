"""Folders a whole test run shares (prepared data, trained models), built once by the first
xdist worker that asks."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import REPO


def built_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]
) -> Path:
    """A session fixture's folder, built once for the whole run rather than once per xdist
    worker: `build(folder)` runs in the first worker that asks, and the others wait for it and
    read what it wrote (two workers training the same model at once would each take twice as
    long). Tests read such a folder and write elsewhere. A build that failed is tried again by
    the next worker that asks."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's folder, above each worker's own
    folder, built = base / name, base / f"{name}.built"
    with FileLock(str(base / f"{name}.lock")):
        if not built.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            built.touch()
    return folder


# Data preparation for the encoder families: a WordPiece vocabulary trained on the shipped
# corpus and its documents split into sentences (what bert/tiny and t5/tiny read).
# A lower-cased WordPiece vocabulary of 2000 tokens that data preparation trained on the shipped
# corpus once. The tests bring it rather than train one: the `tokenizers` trainer breaks ties in
# hash-map order (tokenizers issue #1794), so each training gives another vocabulary, and with
# it other models and other numbers from every test built on them.
WORDPIECE_VOCAB = REPO / "tests" / "data" / "wordpiece_vocab.txt"
WORDPIECE_DATA = (
    "data_preparation.split_sentences=true",
    "data_preparation.lower_case=true",
)
