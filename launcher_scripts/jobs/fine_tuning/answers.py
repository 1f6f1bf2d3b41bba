"""What the tuner's validation and the tuned-model evaluation share: logits behind the
virtual-token placeholders, the exact-string match, and the predictions file."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launcher_scripts.files import write_atomic


def prompt_logits(runner: Any, prefix: list[int], multiple: int = 1) -> Callable[..., Any]:
    """A logits function for generation that puts `prefix` (virtual-token placeholders, BOS)
    before every row and returns the logits of the rows' own positions only.

    `multiple`: sequence parallelism splits the sequence over TP ranks, so the widest row is
    padded to a multiple of TP (later positions do not change earlier logits: causal)."""

    def logits(batch: list[list[int]]) -> Any:
        rows = [prefix + row for row in batch]
        width = max(len(row) for row in rows)
        widest = max(range(len(rows)), key=lambda i: len(rows[i]))
        rows[widest] = rows[widest] + [runner.tokenizer.eod_id] * (-width % multiple)
        return runner.logits(rows)[:, len(prefix) : width, :]

    return logits


def exact_match(prediction: str, answers: list[str]) -> bool:
    """NeMo's exact_string_match: the stripped text equals one of the answers."""
    return prediction.strip() in {a.strip() for a in answers}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    write_atomic(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
