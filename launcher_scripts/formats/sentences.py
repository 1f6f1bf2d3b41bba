"""A small rule-based sentence splitter, for BERT's sentence-split datasets.

Megatron's preprocess_data.py splits with NLTK's punkt model, which must be downloaded as
NLTK data; these jobs must run where nothing can be downloaded, so the rules are written here:

* a sentence ends at `.`, `?` or `!` (a run of them, then any closing quotes or brackets),
  followed by whitespace and then a capital letter, a digit, or an opening quote or bracket;
* not after a known abbreviation ("Dr.", "e.g.", "U.S."), a single-letter initial ("J."), or
  a reference abbreviation followed by a number ("No. 5", "pp. 10");
* a blank line (a paragraph break) always ends a sentence.

Sentences come back stripped of surrounding whitespace, without empty ones. Languages without
letter case (Chinese, Japanese, ...) and punctuation other than .?! are not split.
"""

from __future__ import annotations

import re

# Words that, with their period, seldom end a sentence (lower case, without the final period).
# fmt: off
ABBREVIATIONS = frozenset((
    "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "mt", "messrs", "mme", "mlle", "rev",
    "hon", "gen", "col", "capt", "lt", "sgt", "gov", "sen", "rep", "pres", "supt", "e.g", "i.e",
    "cf", "viz", "vs", "al", "approx", "dept", "est", "inc", "ltd", "co", "corp", "bros", "jan",
    "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec",
))
# Abbreviations that precede a number: they end no sentence only when a digit follows.
NUMBERED_ABBREVIATIONS = frozenset((
    "no", "nos", "fig", "figs", "vol", "vols", "p", "pp", "ch", "sec", "art", "eq", "ed",
))
# fmt: on
_OPENERS = "\"'“‘«([{"
_CLOSERS = "\"'”’»)]}"
# End punctuation, closing quotes/brackets, whitespace: a candidate boundary.
_CANDIDATE = re.compile(rf"[.?!]+[{re.escape(_CLOSERS)}]*\s+")
_PARAGRAPH_BREAK = re.compile(r"\n[^\S\n]*\n\s*")
_INITIALS = re.compile(r"(?:[A-Za-z]\.)+[A-Za-z]")  # "U.S" of "U.S.", "e.g" of "e.g."


def split_sentences(text: str) -> list[str]:
    """The sentences of `text`, in order, by the rules above."""
    sentences: list[str] = []
    for paragraph in _PARAGRAPH_BREAK.split(text):
        start = 0
        for match in _CANDIDATE.finditer(paragraph):
            end = match.end()
            if end < len(paragraph) and _ends_sentence(paragraph, match.start(), end):
                _keep(sentences, paragraph[start:end])
                start = end
        _keep(sentences, paragraph[start:])
    return sentences


def _keep(sentences: list[str], piece: str) -> None:
    piece = piece.strip()
    if piece:
        sentences.append(piece)


def _ends_sentence(text: str, punctuation: int, following: int) -> bool:
    """Whether the punctuation at `punctuation` ends a sentence, the next one starting at
    `following` (past the whitespace)."""
    first = text[following]
    if first in _OPENERS:
        next_char = text[following + 1 : following + 2]
        starts = bool(next_char) and (next_char.isupper() or next_char.isdigit())
    else:
        starts = first.isupper() or first.isdigit()
    if not starts:
        return False
    if text[punctuation] != "." or text[punctuation + 1 : punctuation + 2] == ".":
        return True  # ? or !, or an ellipsis: no abbreviation ends so
    word = _word_before(text, punctuation)
    lowered = word.lower()
    if len(word) == 1 and word.isalpha():
        return False  # an initial: "J. Smith"
    if lowered in ABBREVIATIONS or _INITIALS.fullmatch(word):
        return False
    return not (lowered in NUMBERED_ABBREVIATIONS and first.isdigit())


def _word_before(text: str, end: int) -> str:
    """The word ending at `end`, without opening quotes or brackets."""
    start = end
    while start > 0 and not text[start - 1].isspace() and end - start < 32:
        start -= 1
    return text[start:end].lstrip(_OPENERS)
