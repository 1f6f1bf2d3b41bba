"""Regenerate tiny_corpus.jsonl.gz, the corpus the default recipe prepares out of the box.

It is synthetic on purpose: made here, owned by no one, and regular enough (simple grammar
over a few thousand invented words) that a tiny model visibly learns from it.
Run: python3 launcher_scripts/sample_data/make_tiny_corpus.py
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

OUTPUT = Path(__file__).with_name("tiny_corpus.jsonl.gz")
DOCUMENTS = 4000
ONSETS = [
    "b",
    "br",
    "c",
    "ch",
    "d",
    "dr",
    "f",
    "g",
    "gl",
    "h",
    "j",
    "k",
    "l",
    "m",
    "n",
    "p",
    "pl",
    "qu",
    "r",
    "s",
    "sh",
    "sk",
    "st",
    "t",
    "th",
    "tr",
    "v",
    "w",
    "z",
]
VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "y"]
CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck", "rn"]
TEMPLATES = [
    "The {adj} {noun} {verb} the {noun2} near {place}.",
    "A {noun} from {place} {verb} {count} {noun2}s before {time}.",
    "Every {noun} {verb} when the {noun2} is {adj}.",
    "In {place}, {count} {adj} {noun}s {verb} together.",
    "Why does the {noun} {verb_base} the {adj} {noun2}?",
    "{name} said that the {noun2} {verb} at {time}.",
]
SEED = 20261122
TIMES = ["dawn", "noon", "dusk", "midnight", "the festival", "the long winter"]


def word(rng: random.Random, syllables: int) -> str:
    return "".join(
        rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(syllables)
    )


def lexicon(rng: random.Random, size: int, syllables: tuple[int, int]) -> list[str]:
    return sorted({word(rng, rng.randint(*syllables)) for _ in range(size)})


def corpus_lexicon(rng: random.Random) -> dict[str, list[str]]:
    """The corpus's words, drawn first from `rng` (seeded with SEED)."""
    return {
        "noun": lexicon(rng, 2500, (1, 3)),
        "verb": lexicon(rng, 900, (1, 2)),
        "adj": lexicon(rng, 900, (2, 3)),
        "place": lexicon(rng, 600, (2, 4)),
    }


def fill(rng: random.Random, words: dict[str, list[str]], template: str, verb: str) -> str:
    """One sentence: `template` with the rest of its words drawn from `rng`."""
    sentence = template.format(
        adj=rng.choice(words["adj"]),
        noun=rng.choice(words["noun"]),
        noun2=rng.choice(words["noun"]),
        verb=verb + "s",
        verb_base=verb,
        place=rng.choice(words["place"]).capitalize(),
        name=rng.choice(words["place"]).capitalize(),
        count=rng.randint(2, 999),
        time=rng.choice(TIMES),
    )
    return sentence[0].upper() + sentence[1:]


def document(rng: random.Random, words: dict[str, list[str]]) -> str:
    sentences = []
    for _ in range(rng.randint(3, 12)):
        verb = rng.choice(words["verb"])
        sentences.append(fill(rng, words, rng.choice(TEMPLATES), verb))
    return " ".join(sentences)


def main() -> None:
    rng = random.Random(SEED)
    words = corpus_lexicon(rng)
    # mtime=0 keeps the file byte-identical across regenerations.
    with OUTPUT.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as out:
        for index in range(DOCUMENTS):
            line = json.dumps({"id": index, "text": document(rng, words)}) + "\n"
            out.write(line.encode())
    print(f"wrote {OUTPUT} ({OUTPUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
