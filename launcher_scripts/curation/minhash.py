"""MinHash signatures and the LSH banding that turns a Jaccard threshold into candidates.

A signature is `num_hashes` minima of independent hash permutations of a document's n-gram
set (multiply-shift hashing: (a*h + b) mod 2^64, top 32 bits). Two documents agree on one
minimum with probability equal to their Jaccard similarity, so the fraction of agreeing
minima estimates it, a cheap check of a candidate pair; the exact check compares the two
shingle sets themselves. Candidates come from LSH: the signature cut into `bands` bands of
`rows` minima, two documents sharing any band hash being candidates. (bands, rows) are chosen
from the threshold; a false positive costs only its check, so misses weigh 19 times as much
(at 0.8 and 128 hashes: 16 bands of 8 rows; a pair at 0.8 is a candidate with probability
0.95, one at 0.5 with 0.06).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from launcher_scripts.curation.shingles import ngram_hashes

# Shingles are hashed against the permutations this many at a time (bounds the memory a
# very long document takes: chunk x num_hashes x 8 bytes).
_CHUNK = 4096


@dataclass(frozen=True)
class Banding:
    bands: int
    rows: int


def banding(threshold: float, num_hashes: int, false_positive_weight: float = 0.05) -> Banding:
    """The (bands, rows) with bands x rows <= num_hashes that minimise the weighted areas of
    false positives (pairs below the threshold becoming candidates) and false negatives
    (pairs above it not), the criterion datasketch's MinHashLSH uses."""
    grid = np.linspace(0.0, 1.0, 2001)

    def area(bands: int, rows: int, low: float, high: float) -> float:
        x = grid[(grid >= low) & (grid <= high)]
        candidate = 1.0 - (1.0 - x**rows) ** bands
        y = candidate if high <= threshold else 1.0 - candidate
        return float(np.trapezoid(y, x))

    best, best_error = Banding(1, num_hashes), float("inf")
    for bands in range(1, num_hashes + 1):
        for rows in range(1, num_hashes // bands + 1):
            error = false_positive_weight * area(bands, rows, 0.0, threshold) + (
                1 - false_positive_weight
            ) * area(bands, rows, threshold, 1.0)
            if error < best_error:
                best, best_error = Banding(bands, rows), error
    return best


class MinHasher:
    def __init__(self, num_hashes: int, ngram: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.ngram = ngram
        self.a = (
            rng.integers(1, 1 << 63, num_hashes, dtype=np.uint64) << np.uint64(1)
        ) | np.uint64(1)
        self.b = rng.integers(0, 1 << 63, num_hashes, dtype=np.uint64)
        self.num_hashes = num_hashes

    def shingles(self, text: str) -> np.ndarray:
        """The document's shingle set: its n-grams' hashes, sorted, without repeats."""
        return np.unique(ngram_hashes(text, self.ngram))

    def signature(self, shingles: np.ndarray) -> np.ndarray:
        """The signature (uint32 x num_hashes) of a shingle set; all-max for an empty one."""
        result = np.full(self.num_hashes, np.iinfo(np.uint32).max, dtype=np.uint32)
        with np.errstate(over="ignore"):
            for start in range(0, len(shingles), _CHUNK):
                chunk = shingles[start : start + _CHUNK]
                permuted = (chunk[None, :] * self.a[:, None] + self.b[:, None]) >> np.uint64(32)
                np.minimum(result, permuted.min(axis=1).astype(np.uint32), out=result)
        return result


def band_keys(signature: np.ndarray, banding: Banding) -> list[int]:
    """One 64-bit key per band: a hash of the band's minima, salted with the band's index so
    that equal minima in different bands do not collide."""
    rows = banding.rows
    return [
        xxhash.xxh64_intdigest(signature[band * rows : (band + 1) * rows].tobytes(), seed=band)
        for band in range(banding.bands)
    ]


def exact_jaccard(first: np.ndarray, second: np.ndarray) -> float:
    """The Jaccard similarity of two shingle sets (sorted, without repeats)."""
    if len(first) == 0 and len(second) == 0:
        return 1.0
    common = len(np.intersect1d(first, second, assume_unique=True))
    return common / (len(first) + len(second) - common)
