"""The tokenizer's vocabulary against the token ids of the training data.

Data tokenized with another tokenizer than the recipe's holds ids the model's embedding either
lacks (megatron-core fails deep in the first step: an IndexError, or a device-side assert on
a GPU) or has only as padding rows (training goes on, on the wrong text). Both are caught here,
before anything is submitted (the launcher's preflight) and again when the job starts (the data
or the tokenizer may be written by an earlier stage of the same run).

The bound is the tokenizer's own size, the number the job builds the model from
(data.vocab_info): every id a tokenizer writes is below it. The padded vocabulary
(make_vocab_size_divisible_by) is not the bound: ids in the padding are no text of this
tokenizer either.

The largest id of a dataset comes from the statistics data preparation records beside it
(indexed_writer.read_stats), so the check reads a few bytes even of terabytes of data. Without
them, the dtype of the .idx bounds the ids (a uint16 dataset holds no id above 65535), and
.bin files are scanned while the bytes scanned stay within SCAN_LIMIT_BYTES (for all the
datasets of a blend together); the rest, without statistics, are not checked.

Torch-free: the launcher's preflight imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from launcher_scripts.errors import ConfigError
from launcher_scripts.formats import indexed_writer
from launcher_scripts.formats.tokenizer import TokenizerError, TokenizerSpec, load_tokenizer

SCAN_LIMIT_BYTES = 1 << 30
SCAN_CHUNK_ITEMS = 1 << 24


def tokenizer_spec(cfg: Any) -> TokenizerSpec:
    """The recipe's tokenizer, loaded for its vocabulary (no engine comparison)."""
    tokenizer = cfg.model.tokenizer
    return TokenizerSpec(
        model=tokenizer.get("model"),
        vocab_file=tokenizer.get("vocab_file"),
        merge_file=tokenizer.get("merge_file"),
        engine="tokenizers",
    )


def tokenizer_key(cfg: Any, stage: str) -> str:
    """The recipe key that names the tokenizer's main file."""
    name = "model" if cfg.model.tokenizer.get("model") else "vocab_file"
    return f"{stage}.model.tokenizer.{name}"


@dataclass(frozen=True)
class LargestId:
    value: int
    exact: bool  # False: only a bound (the dtype's largest value)
    how: str  # where it comes from, for messages


def largest_token_id(prefix: str | Path, scan_limit: int | None = None) -> LargestId | None:
    """The largest token id of a dataset, or a bound on it when it has no statistics and its
    .bin is larger than `scan_limit` bytes (default SCAN_LIMIT_BYTES); None when it has no
    tokens or is no dataset this can read."""
    stats = indexed_writer.read_stats(prefix)
    if stats is not None and stats.get("max_token_id") is not None:
        return LargestId(int(stats["max_token_id"]), True, "recorded")
    try:
        header = indexed_writer.read_header(indexed_writer.idx_path(prefix))
        size = indexed_writer.bin_path(prefix).stat().st_size
    except (OSError, ValueError):
        return None  # not there yet, or not an indexed dataset: other checks say so
    dtype = np.dtype(header.dtype)
    if dtype.kind not in "iu" or size == 0:
        return None
    if size <= (SCAN_LIMIT_BYTES if scan_limit is None else scan_limit):
        data = np.memmap(indexed_writer.bin_path(prefix), dtype=dtype, mode="r")
        largest = max(
            int(data[start : start + SCAN_CHUNK_ITEMS].max())
            for start in range(0, data.size, SCAN_CHUNK_ITEMS)
        )
        return LargestId(largest, True, "scanned")
    return LargestId(int(np.iinfo(dtype).max), False, f"its dtype {dtype.name}")


def largest_token_ids(prefixes: Sequence[str]) -> dict[str, int]:
    """The datasets whose largest token id is known exactly, and that id."""
    known = {}
    budget = SCAN_LIMIT_BYTES
    for prefix in prefixes:
        largest = largest_token_id(prefix, budget)
        if largest is not None and largest.exact:
            known[prefix] = largest.value
            if largest.how == "scanned":
                budget -= indexed_writer.bin_path(prefix).stat().st_size
    return known


def check_token_ids(
    prefixes: Sequence[str] | dict[str, int],
    vocab_size: int,
    tokenizer: str,
    key: str,
    stage: str,
) -> None:
    """ConfigError naming the tokenizer `key` and the first dataset that holds an id at or
    above `vocab_size` (`prefixes`: the datasets, or largest_token_ids of them)."""
    known = prefixes if isinstance(prefixes, dict) else largest_token_ids(prefixes)
    for prefix, largest in known.items():
        if largest < vocab_size:
            continue
        raise ConfigError(
            key,
            f"{tokenizer} has {vocab_size} tokens, but {stage}.model.data.data_prefix "
            f"{prefix} holds token id {largest}: it was tokenized with another tokenizer",
            "Use the tokenizer the data was prepared with, or prepare the data again with "
            "this one (data_preparation)",
        )


def check_training_data(cfg: Any, stage: str, prefixes: Sequence[str]) -> None:
    """check_token_ids for a recipe whose data and tokenizer exist now (a dry run, or a run
    whose earlier stage writes them, leaves it to the job's start). The tokenizer is loaded
    only when some dataset's largest id is known."""
    if cfg.model.get("restore_from_path"):
        return  # the tokenizer is in the restored file: the job checks the data against it
    known = largest_token_ids(prefixes)
    spec = tokenizer_spec(cfg)
    files = [spec.model, spec.vocab_file, spec.merge_file]
    if not known or not all(Path(str(f)).is_file() for f in files if f):
        return
    key = tokenizer_key(cfg, stage)
    try:
        vocab_size = load_tokenizer(spec).vocab_size
    except TokenizerError as error:
        raise ConfigError(key, str(error), "Give the tokenizer's files") from None
    check_token_ids(known, vocab_size, str(spec.model or spec.vocab_file), key, stage)
