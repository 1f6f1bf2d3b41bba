"""Small BERT WordPiece vocabularies and sentence corpora for the data-preparation tests.

The documents are built from sentences listed here, so a test knows the sentences each
document must split into without running the splitter, and can decode token ids back to text
with the vocabulary alone.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PUNCTUATION = (".", ",", "!", "?")
# fmt: off
WORDS = (
    "the", "an", "cat", "dog", "sat", "on", "mat", "river", "mountain", "runs", "quickly",
    "and", "music", "history", "energy", "model", "data", "is", "was", "here", "there", "big",
    "small", "we", "like", "it", "today", "in", "of", "village", "century",
)
# fmt: on
# Words only in "Dr. Smith", never at a sentence's end, where the splitter takes "dr." as
# the abbreviation.
NAME = ("dr", "smith")
# Words the vocabulary holds only as pieces: "runner" is run + ##ner, and so on.
PIECES = {"runner": ("run", "##ner"), "villages": ("village", "##s"), "cats": ("cat", "##s")}


def write_vocab(path: Path, cased: bool) -> Path:
    """A vocab.txt: the specials, punctuation, the words (also capitalised when `cased`),
    and the pieces of PIECES."""
    tokens = [*SPECIALS, *PUNCTUATION, *WORDS, *NAME]
    if cased:
        tokens += [word.capitalize() for word in (*WORDS, *NAME)]
    for first, *rest in PIECES.values():
        starts = (first, first.capitalize()) if cased else (first,)
        tokens += [piece for piece in (*starts, *rest) if piece not in tokens]
    path.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    return path


def sentence(rng: random.Random) -> str:
    words = [rng.choice((*WORDS, *PIECES)) for _ in range(rng.randint(2, 9))]
    if rng.random() < 0.2:
        words[1:1] = ["Dr.", "Smith"]  # an abbreviation inside the sentence: no split there
    words[0] = words[0].capitalize()
    if rng.random() < 0.3:
        words.insert(rng.randint(1, len(words) - 1), ",")
    text = " ".join(words).replace(" ,", ",")
    return text + rng.choice((".", ".", "!", "?"))


def documents(count: int, seed: int) -> list[list[str]]:
    """`count` documents as lists of sentences; a few are empty."""
    rng = random.Random(seed)
    return [[sentence(rng) for _ in range(rng.choice((0, 1, 2, 3, 5)))] for _ in range(count)]


def join(document: list[str], seed: int = 0) -> str:
    """A document's text: its sentences with spaces or paragraph breaks between them."""
    rng = random.Random(seed)
    text = ""
    for index, item in enumerate(document):
        text += (rng.choice((" ", "  ", "\n\n")) if index else "") + item
    return text


def decode(ids: list[int], vocab: list[str]) -> str:
    """WordPiece ids back to text: pieces joined, punctuation attached to the word before."""
    text = " ".join(vocab[i] for i in ids).replace(" ##", "")
    return re.sub(r" ([.,!?])", r"\1", text)
