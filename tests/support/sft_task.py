"""A small supervised task for the fine-tuning tests: a fixed, arbitrary mapping from words to
words that a model cannot know zero-shot.

The answers are words the tokenizer keeps as one token, chosen among those whose output
embeddings are largest: a frozen-embedding method (every PEFT method) can only raise a token's
logit as far as its embedding's norm allows, and the briefly trained tiny model has left most
rows near their small initial values. Full fine-tuning has no such limit.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

KEYS = [
    "river",
    "mountain",
    "village",
    "morning",
    "garden",
    "window",
    "market",
    "winter",
    "forest",
    "island",
]
CANDIDATES = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "it",
    "an",
    "be",
    "are",
    "this",
    "had",
    "not",
    "but",
    "have",
    "one",
    "which",
    "were",
    "all",
    "they",
    "their",
    "been",
    "has",
    "more",
    "two",
    "its",
    "who",
    "after",
    "first",
    "new",
    "also",
    "time",
    "other",
    "into",
    "when",
    "there",
    "would",
    "can",
    "only",
    "out",
    "some",
    "year",
    "so",
    "up",
    "does",
    "A",
    "Why",
    "The",
    "Every",
    "In",
]


def answer_words(tokenizer, embeddings: torch.Tensor, count: int) -> list[str]:  # type: ignore[no-untyped-def]
    """`count` single-token words, those with the largest embedding rows first."""
    ids = {w: tokenizer.encode(" " + w) for w in CANDIDATES}
    single = [w for w in CANDIDATES if len(ids[w]) == 1]
    single.sort(key=lambda w: -float(embeddings[ids[w][0]].norm()))
    if len(single) < count:
        raise AssertionError(f"only {len(single)} single-token words: {single}")
    return single[:count]


def write_task(
    folder: Path,
    tokenizer,  # type: ignore[no-untyped-def]
    embeddings: torch.Tensor,
    pairs: int = 8,
) -> dict[str, Path]:
    """train.jsonl, val.jsonl and test.jsonl, all the same mapping: the task is to learn it."""
    values = answer_words(tokenizer, embeddings, pairs)
    random.Random(0).shuffle(values)
    rows = [{"input": k, "output": v} for k, v in zip(KEYS[:pairs], values, strict=True)]
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in ("train", "val", "test"):
        paths[name] = folder / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths


# Words that are each one token of the tests' WordPiece vocabulary (tests/data/wordpiece_vocab.txt,
# trained on the shipped corpus): the inputs and answers of the text-to-text task, so that an
# input is one token and an answer one token and [EOS].
TEXT_TO_TEXT_KEYS = ["winter", "midnight", "dusk", "dawn", "festival", "noon", "together", "before"]
TEXT_TO_TEXT_ANSWERS = ["the", "near", "why", "does", "from", "that", "when", "every"]


def write_text_to_text_task(folder: Path) -> dict[str, tuple[Path, Path]]:
    """T5's layout of the task: per split, a file of inputs and a file of their answers, line
    by line; every split holds the whole mapping."""
    values = list(TEXT_TO_TEXT_ANSWERS)
    random.Random(0).shuffle(values)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in ("train", "val", "test"):
        source, target = folder / f"{name}_src.txt", folder / f"{name}_tgt.txt"
        source.write_text("".join(f"{key}\n" for key in TEXT_TO_TEXT_KEYS))
        target.write_text("".join(f"{value}\n" for value in values))
        paths[name] = (source, target)
    return paths


def write_mapping_task(folder: Path) -> dict[str, Path]:
    """A made-up word mapping (the same rows everywhere): what a random model cannot know."""
    keys = ["river", "village", "morning", "north", "market", "winter", "garden", "harbor"]
    values = ["quiet", "stone", "light", "early", "bridge", "green", "salt", "rain"]
    rows = [{"input": f"{k} means", "output": v} for k, v in zip(keys, values, strict=True)]
    folder.mkdir(parents=True)
    paths = {name: folder / f"{name}.jsonl" for name in ("train", "val", "test")}
    for path in paths.values():
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths
