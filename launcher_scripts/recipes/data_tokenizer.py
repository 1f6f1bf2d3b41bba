"""The tokenizer a training recipe names against the one its data was tokenized with.

Data preparation records, beside each dataset it writes, the content hash of each tokenizer
file it used (fingerprint.py: "tokenizer", by role: model, vocab_file, merge_file) and their
paths ("tokenizer_files"). Ids of one tokenizer read as another's are wrong text that trains
without an error whenever they fit the other's vocabulary (vocabulary.py catches the rest):
T5 on the ids of GPT's SentencePiece model, GPT on WordPiece ids. So preflight compares the
files: a dataset's recorded hashes with the recipe's files, and a dataset an earlier stage of
the same run writes with the files that stage tokenizes it with.

Torch-free: the launcher's preflight imports it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from launcher_scripts.errors import ConfigError
from launcher_scripts.formats import fingerprint
from launcher_scripts.recipes import restore
from launcher_scripts.recipes.training import key

# The tokenizer files by the roles data preparation records them under (its --tokenizer-model,
# --vocab-file and --merge-file), which are the recipe's tokenizer keys.
ROLES = ("model", "vocab_file", "merge_file")

TokenizerFiles = Mapping[str, str]  # role -> path


def recipe_files(cfg: Any) -> dict[str, str]:
    """The tokenizer files the recipe names, by role."""
    tokenizer = cfg.model.tokenizer
    return {role: str(tokenizer[role]) for role in ROLES if tokenizer.get(role)}


def _described(files: Mapping[str, str | None], hashes: Mapping[str, str | None]) -> str:
    """`role path (sha256 abcdef012345)` for each role, a path or a hash where only one is
    known."""
    parts = []
    for role in sorted(files.keys() | hashes.keys()):
        digest = hashes.get(role)
        shown = f" (sha256 {digest[:12]})" if digest else ""
        parts.append(f"{role} {files.get(role) or ''}{shown}".replace("  ", " "))
    return ", ".join(parts)


def _refuse(cfg: Any, stage: str, problem: str) -> ConfigError:
    main = "model" if cfg.model.tokenizer.get("model") else "vocab_file"
    return ConfigError(
        key(stage, f"model.tokenizer.{main}"),
        problem,
        "Train with the tokenizer the data was tokenized with, or prepare the data again with "
        "this one (data_preparation)",
    )


def _same_file(ours: str | None, theirs: str) -> bool:
    """The same path, or two files of the same content (a copy)."""
    if ours is None:
        return False
    if Path(ours) == Path(theirs):
        return True
    mine, other = fingerprint.file_hash(ours), fingerprint.file_hash(theirs)
    return mine is not None and mine == other


def check_planned(cfg: Any, stage: str, prefix: str, planned: TokenizerFiles) -> None:
    """A dataset an earlier stage of this run writes with `planned`'s files."""
    ours = recipe_files(cfg)
    if set(ours) == set(planned) and all(_same_file(ours[r], planned[r]) for r in planned):
        return
    raise _refuse(
        cfg,
        stage,
        f"the recipe's tokenizer ({_described(ours, {})}) is not the one this run's "
        f"data_preparation tokenizes {key(stage, 'model.data.data_prefix')} {prefix} with "
        f"({_described(planned, {})})",
    )


def check_recorded(cfg: Any, stage: str, prefix: str) -> None:
    """A dataset on disk, against the tokenizer hashes recorded beside it (nothing to compare
    without a record, or with a recipe file not there yet)."""
    made = fingerprint.recorded_fingerprint(prefix) or {}
    recorded = {role: h for role, h in (made.get("tokenizer") or {}).items() if h}
    if not recorded:
        return
    ours = recipe_files(cfg)
    if not all(Path(path).is_file() for path in ours.values()):
        return  # written by an earlier stage of this run: nothing to hash yet
    hashes = {role: fingerprint.file_hash(path) for role, path in ours.items()}
    if hashes == recorded:
        return
    paths = made.get("tokenizer_files") or {}
    raise _refuse(
        cfg,
        stage,
        f"the recipe's tokenizer ({_described(ours, hashes)}) is not the one "
        f"{key(stage, 'model.data.data_prefix')} {prefix} was tokenized with "
        f"({_described({r: paths.get(r) for r in recorded}, recorded)}, as "
        f"{fingerprint.record_path(prefix).name} records)",
    )


def check_data_tokenizer(
    cfg: Any, stage: str, prefixes: Sequence[str], planned: Mapping[str, TokenizerFiles]
) -> None:
    """Every dataset of the recipe's blend was (or, by an earlier stage of this run, will be)
    tokenized with the recipe's tokenizer. A recipe restoring a model takes the model's
    tokenizer, which the job checks the data against."""
    if restore.restore_path(cfg.model):
        return
    written = {str(Path(prefix)): files for prefix, files in planned.items()}
    for prefix in prefixes:
        if str(Path(prefix)) in written:
            check_planned(cfg, stage, prefix, written[str(Path(prefix))])
        else:
            check_recorded(cfg, stage, prefix)
