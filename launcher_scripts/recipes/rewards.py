"""Verifiable rewards the grpo stage ships (`model.grpo.reward_functions`).

Each is called once per completion as function(prompt, completion, **fields, **kwargs), where
the fields are the prompt's JSONL record's other keys (an `answer`, say), and returns a
number. Write your own alike in any importable module and name it `module:function`.

Pure Python, no torch: the launcher's preflight imports them to check they exist.
"""

from __future__ import annotations

import re
from typing import Any

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_HASHES = re.compile(r"####\s*([^\n]*)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_answer(completion: str) -> str | None:
    """A math-style completion's final answer: the last \\boxed{...}, else what follows the
    last ####, else the last number in it; None when it has none."""
    for pattern in (_BOXED, _HASHES):
        found = pattern.findall(completion)
        if found:
            return found[-1].strip()
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def _normal(answer: str) -> str:
    text = answer.strip().rstrip(".").replace(",", "").replace("$", "")
    try:
        value = float(text)
    except ValueError:
        return " ".join(text.split()).lower()
    return str(int(value)) if value == int(value) else repr(value)


def exact_answer(prompt: str, completion: str, answer: Any = None, **_: Any) -> float:
    """1.0 when the completion's final answer (final_answer) equals the record's `answer`, as
    numbers where both are (so 7, 7.0 and 7. agree) or as text up to case and spaces."""
    del prompt
    if answer is None:
        raise ValueError("exact_answer needs an 'answer' field in each prompt record")
    found = final_answer(completion)
    return float(found is not None and _normal(found) == _normal(str(answer)))


def matches_format(prompt: str, completion: str, pattern: str = "", **_: Any) -> float:
    """1.0 when the whole completion (spaces at its ends aside) matches the regular
    expression `pattern` (given in the reward's kwargs)."""
    del prompt
    if not pattern:
        raise ValueError("matches_format needs kwargs: {pattern: <regular expression>}")
    return float(re.fullmatch(pattern, completion.strip(), flags=re.DOTALL) is not None)
