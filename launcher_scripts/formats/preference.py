"""The preference-pair record the reward-model and DPO stages read, one JSON object per line:

    {"prompt": PROMPT, "chosen": "the preferred answer", "rejected": "the other answer"}

PROMPT is a text, or a conversation: a list of {"role": "system" | "user" | "assistant",
"content": text} ending with a user turn. Torch-free: the stages' preflight checks files with
it, and the converter (jobs/data_prep/preference_convert.py) what it writes.
"""

from __future__ import annotations

from typing import Any

ROLES = ("system", "user", "assistant")


def preference_problem(record: Any) -> str | None:
    """Why a record is not a preference pair of the format above; None when it is."""
    problem = prompt_problem_of(record, "the answers")
    if problem is not None:
        return problem
    for name in ("chosen", "rejected"):
        if not is_text(record.get(name)):
            return f"'{name}' missing or not a non-blank text"
    if record["chosen"].strip() == record["rejected"].strip():
        return "'chosen' and 'rejected' are the same text: the pair prefers nothing"
    return None


def prompt_problem_of(record: Any, following: str) -> str | None:
    """Why a record is not a JSON object with a "prompt" (a text, or turns ending with a user
    turn, which `following` follows); None when it is."""
    if not isinstance(record, dict):
        return "not a JSON object"
    prompt = record.get("prompt")
    if isinstance(prompt, list):
        problem = conversation_problem(prompt, "prompt")
        if problem:
            return problem
        if prompt[-1]["role"] != "user":
            return f"'prompt' must end with a user turn ({following} follow it)"
    elif not is_text(prompt):
        return "'prompt' missing" if prompt is None else "'prompt' is neither a text nor turns"
    return None


def conversation_problem(turns: list[Any], name: str) -> str | None:
    if not turns:
        return f"'{name}' has no turns"
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return f"{name}[{index}] is not an object"
        if turn.get("role") not in ROLES:
            return f"{name}[{index}].role is {turn.get('role')!r}, not one of {', '.join(ROLES)}"
        if not is_text(turn.get("content")):
            return f"{name}[{index}].content missing or blank"
    return None


def is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())
