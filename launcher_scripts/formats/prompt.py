"""The prompt record the grpo and rlhf_ppo stages read, one JSON object per line:

    {"prompt": PROMPT, "answer": "7", ...}

PROMPT is a text, or a conversation ending with a user turn (formats/preference.py). Every
other key is handed to the reward functions as a keyword argument (`answer` to exact_answer).
The reference's PPO prompt files, {"text": PROMPT} (its section 5.16.2.4), read alike. Torch-free:
the stage's preflight checks files with it.
"""

from __future__ import annotations

from typing import Any

from launcher_scripts.formats.preference import prompt_problem_of

# Keys the reward functions receive from the stage itself, which a record may not hold.
RESERVED = ("completion",)


def as_prompt_record(record: Any) -> Any:
    """A record of the reference's {"text": prompt} as {"prompt": prompt}; others as they are."""
    if isinstance(record, dict) and "prompt" not in record and "text" in record:
        return {"prompt": record["text"], **{k: v for k, v in record.items() if k != "text"}}
    return record


def prompt_problem(record: Any) -> str | None:
    """Why a record is not a prompt record of the format above; None when it is."""
    record = as_prompt_record(record)
    problem = prompt_problem_of(record, "completions")
    if problem is not None:
        return problem
    taken = [key for key in RESERVED if key in record]
    if taken:
        return f"{taken[0]!r} is a name the stage passes to reward functions: rename that key"
    return None
