"""The export's lambada check (NeMo's export evaluates the exported GPT and T5 models on lambada,
to compare with the evaluation stage): `export.check.lambada_file`, a JSONL of {"text": ...}
passages (lambada_test.jsonl), each to be completed with its last word.

An example is right when greedy decoding of the passage without its last word gives exactly the
tokens of " <last word>": lm-eval's lambada `acc` (is_greedy), so the number is comparable with
the evaluation stage's. Torch-free: the stage checks the file, the export job scores it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher_scripts.config.checks import require_file, require_int
from launcher_scripts.errors import ConfigError

KEY = "export.check.lambada_file"


@dataclass(frozen=True)
class Example:
    context: str  # the passage up to its last word (no trailing space)
    target: str  # " " + the last word


def split(text: str) -> Example | None:
    """The passage's context and last word; None for a passage of one word."""
    context, _, last = text.strip().rpartition(" ")
    return Example(context, f" {last}") if context and last else None


def read_examples(path: Path, limit: int | None = None, key: str = KEY) -> list[Example]:
    examples = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (ValueError, KeyError, TypeError):
                raise ConfigError(
                    key, f"{path}:{number} is not a JSON object with a text", "Fix the line"
                ) from None
            example = split(str(text))
            if example is not None:
                examples.append(example)
            if limit is not None and len(examples) == limit:
                break
    if not examples:
        raise ConfigError(key, f"{path} holds no passage of two words or more", "Give lambada")
    return examples


def check_section(check: Any, will_exist: Any = None) -> None:
    """The stage's preflight of the check's lambada keys (null file: no lambada check)."""
    limit = check.get("lambada_limit")
    if limit is not None:
        require_int("export.check.lambada_limit", limit)
    given = check.get("lambada_file")
    if given is None:
        return
    path = Path(str(given))
    if will_exist is not None and not path.exists() and will_exist(path):
        return
    require_file(KEY, path)
    read_examples(path, 1)


def accuracy(right: list[bool]) -> float:
    return sum(right) / len(right)
