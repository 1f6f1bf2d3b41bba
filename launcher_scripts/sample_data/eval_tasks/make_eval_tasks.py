"""Regenerate the offline evaluation sets: tiny_*.jsonl beside this file.

Fresh documents in the grammar and over the lexicon of the tiny corpus (see
../make_tiny_corpus.py), drawn with another seed, so a model trained on that corpus is scored
on text it has not seen, yet whose words and sentence shapes it has learned. Some answers
are predictable from the grammar (a sentence that starts "In <place>, <count> ..." ends in
"together."), so a trained model scores visibly above chance.
Run: python3 launcher_scripts/sample_data/eval_tasks/make_eval_tasks.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from launcher_scripts.sample_data.make_tiny_corpus import SEED as CORPUS_SEED
from launcher_scripts.sample_data.make_tiny_corpus import (
    TEMPLATES,
    corpus_lexicon,
    document,
    fill,
)

HERE = Path(__file__).parent
SEED = 20261123  # not the corpus's: held-out text
EXAMPLES = 30
TOGETHER = TEMPLATES[3]  # "In {place}, {count} {adj} {noun}s {verb} together."


def words() -> dict[str, list[str]]:
    """The corpus's lexicon: drawn first from the corpus's seed, as make_tiny_corpus does."""
    return corpus_lexicon(random.Random(CORPUS_SEED))


def sentence(rng: random.Random, lex: dict[str, list[str]], template: str) -> str:
    return fill(rng, lex, template, rng.choice(lex["verb"]))


def lambada(rng: random.Random, lex: dict[str, list[str]]) -> list[dict]:
    """A short passage; the last word is the target (scored with its leading space)."""
    rows = []
    for index in range(EXAMPLES):
        context = [sentence(rng, lex, rng.choice(TEMPLATES)) for _ in range(rng.randint(1, 3))]
        # Every other passage ends in the predictable "together.".
        last = TOGETHER if index % 2 == 0 else rng.choice(TEMPLATES)
        rows.append({"text": " ".join([*context, sentence(rng, lex, last)])})
    return rows


def choice(rng: random.Random, lex: dict[str, list[str]]) -> list[dict]:
    """A sentence without its last word; four endings, three of them from other sentence
    shapes (a time where a place belongs, "together." where an adjective does)."""
    rows = []
    for _ in range(EXAMPLES):
        template = rng.choice(TEMPLATES)
        text = sentence(rng, lex, template).split(" ")
        others = [t for t in TEMPLATES if t != template]
        wrong: list[str] = []
        while len(wrong) < 3:
            ending = sentence(rng, lex, rng.choice(others)).split(" ")[-1]
            if ending != text[-1] and ending not in wrong:
                wrong.append(ending)
        label = rng.randrange(4)
        endings = [*wrong[:label], text[-1], *wrong[label:]]
        rows.append({"query": " ".join(text[:-1]), "choices": endings, "label": label})
    return rows


def wikitext(rng: random.Random, lex: dict[str, list[str]]) -> list[dict]:
    """Whole documents, some longer than a tiny model's 128 positions (rolling windows)."""
    return [{"page": document(rng, lex)} for _ in range(EXAMPLES)]


def generate(rng: random.Random, lex: dict[str, list[str]]) -> list[dict]:
    """A passage cut before its last word, which is always "together"."""
    rows = []
    for _ in range(EXAMPLES):
        context = [sentence(rng, lex, rng.choice(TEMPLATES)) for _ in range(rng.randint(0, 2))]
        last = sentence(rng, lex, TOGETHER).removesuffix(" together.")
        rows.append({"question": " ".join([*context, last]), "answer": "together"})
    return rows


def main() -> None:
    lex = words()
    rng = random.Random(SEED)
    for name, make in (
        ("tiny_lambada", lambada),
        ("tiny_choice", choice),
        ("tiny_wikitext", wikitext),
        ("tiny_generate", generate),
    ):
        path = HERE / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in make(rng, lex)))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
