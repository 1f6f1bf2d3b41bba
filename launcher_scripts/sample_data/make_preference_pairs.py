"""Regenerate preference_train.jsonl and preference_validation.jsonl: the preference pairs the
reward-model and DPO recipes of the tiny model read out of the box (and the GRPO recipe's
prompts); and time_answers.jsonl: the training prompts, each with a time of the four alike, as
{"input", "output"} records, the brief supervised start of the GRPO example.

The preference has a rule that is known: a prompt is a sentence of the tiny corpus
(make_tiny_corpus.py) up to its time, "A <noun> from <Place> <verb>s <n> <noun>s before";
the chosen answer names a morning time (PREFERRED), the rejected one an evening time
(DISPREFERRED). The corpus uses all of them alike, so a model trained on it has no preference
of its own: a reward model must learn the rule, and DPO must make the policy follow it.
Run: python3 launcher_scripts/sample_data/make_preference_pairs.py
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from launcher_scripts.sample_data.make_tiny_corpus import SEED, corpus_lexicon

PREFERRED = ("dawn", "noon")
DISPREFERRED = ("dusk", "midnight")
SPLITS = {"train": 640, "validation": 128}
FOLDER = Path(__file__).parent


def prompt(rng: random.Random, words: dict[str, list[str]]) -> str:
    place = rng.choice(words["place"]).capitalize()
    count = rng.randint(2, 999)
    return (
        f"A {rng.choice(words['noun'])} from {place} {rng.choice(words['verb'])}s {count} "
        f"{rng.choice(words['noun'])}s before"
    )


def pair(rng: random.Random, words: dict[str, list[str]]) -> dict[str, str]:
    return {
        "prompt": prompt(rng, words),
        "chosen": f" {rng.choice(PREFERRED)}.",
        "rejected": f" {rng.choice(DISPREFERRED)}.",
    }


def follows_rule(answer: str) -> bool:
    """Whether a generated answer names a preferred time first (what the rule asks)."""
    return re.match(rf"\s*({'|'.join(PREFERRED)})\b", answer) is not None


def main() -> None:
    words = corpus_lexicon(random.Random(SEED))  # the corpus' own words
    rng = random.Random(SEED + 1)
    for split, count in SPLITS.items():
        path = FOLDER / f"preference_{split}.jsonl"
        with path.open("w", encoding="utf-8") as out:
            for _ in range(count):
                out.write(json.dumps(pair(rng, words)) + "\n")
        print(f"wrote {path} ({count} pairs)")
    write_time_answers(FOLDER / "preference_train.jsonl", FOLDER / "time_answers.jsonl")


def write_time_answers(pairs: Path, path: Path) -> None:
    """Each pair's prompt answered with any of the four times, alike: a model tuned on them
    answers with a time, half the time a preferred one."""
    rng = random.Random(SEED + 2)
    times = (*PREFERRED, *DISPREFERRED)
    with pairs.open(encoding="utf-8") as lines, path.open("w", encoding="utf-8") as out:
        for line in lines:
            record = {"input": json.loads(line)["prompt"], "output": f"{rng.choice(times)}."}
            out.write(json.dumps(record) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
