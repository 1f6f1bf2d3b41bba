"""The prompt record the grpo stage reads, one JSON object per line:

    {"prompt": PROMPT, "answer": "7", ...}

PROMPT is a text, or a conversation ending with a user turn (formats/preference.py). Every
other key is handed to the reward functions as a keyword argument (`answer` to exact_answer).
Torch-free: the stage's preflight checks files with it.
"""

from __future__ import annotations

from typing import Any

from launcher_scripts.formats.preference import prompt_problem_of

# Keys the reward functions receive from the stage itself, which a record may not hold.
RESERVED = ("completion",)


def prompt_problem(record: Any) -> str | None:
    """Why a record is not a prompt record of the format above; None when it is."""
    problem = prompt_problem_of(record, "completions")
    if problem is not None:
        return problem
    taken = [key for key in RESERVED if key in record]
    if taken:
        return f"{taken[0]!r} is a name the stage passes to reward functions: rename that key"
    return None
