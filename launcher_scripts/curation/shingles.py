"""Words, word n-grams and their 64-bit hashes: what fuzzy dedup and decontamination compare.

Text is compared as lower-case words with punctuation dropped, so that a copy that differs
only in case, spacing or punctuation is the same text. A word is hashed once (xxh64, cached
per process) and an n-gram's hash is a polynomial of its words' hashes, computed for all
n-grams of a document at once with numpy.
"""

from __future__ import annotations

import re
from functools import lru_cache

import numpy as np
import xxhash

_WORD = re.compile(r"\w+")
# An odd 64-bit multiplier for the n-gram polynomial (the golden-ratio constant).
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


@lru_cache(maxsize=1 << 20)
def word_hash(word: str) -> int:
    return xxhash.xxh64_intdigest(word.encode("utf-8"))


def ngram_hashes(text: str, n: int) -> np.ndarray:
    """The hashes of the text's word n-grams (uint64, in order, repeats kept); a text of
    fewer than n words gives one hash, of all its words (none for a text without words)."""
    hashes = np.fromiter((word_hash(w) for w in words(text)), dtype=np.uint64)
    if len(hashes) == 0:
        return hashes
    if len(hashes) < n:
        n = len(hashes)
    count = len(hashes) - n + 1
    with np.errstate(over="ignore"):
        combined = hashes[:count].copy()
        for offset in range(1, n):
            combined = combined * _MULTIPLIER + hashes[offset : offset + count]
    return combined
