"""Long documents cut into pieces that encode to the same ids as the whole.

One engine call on a whole 50 MB document ran at a fifth to a tenth of the speed of the same
text in ordinary documents (the engines' cost per call grows faster than its length), and
the job's progress moved only when the call returned. Cut at spaces, a document encodes in
bounded calls at the usual speed per byte, and progress comes piece by piece.

A cut keeps the ids only where the tokenizer never lets a token span the cut: true of
tokenizers that pre-split text at spaces (SentencePiece's default split_by_whitespace, GPT-2's
byte-level pre-tokenizer, BERT's). Where the space goes (ending the left piece or starting the
right one) depends on the tokenizer, so `cut_style` finds, on probe texts, the style that gives
each probe's ids exactly; a tokenizer for which neither does is never cut.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

# Documents longer than this are cut (shorter ones, nearly all, are encoded as they are) ...
LONG_CHARS = 1 << 16
# ... into pieces of about this many characters: SentencePiece's cost per character grows
# with the length of what it is given (measured: 1.4x at 64k characters, 2.2x at 256k, 5x at
# 4M, against 2k).
PIECE_CHARS = 1 << 12
# Pieces go to the engine in calls of about this many characters; progress after each.
CALL_CHARS = 1 << 20
# A single space between two non-space characters: every tokenizer above splits there.
_CUT = re.compile(r"(?<=\S) (?=\S)")
CUT_STYLES = ("space_first", "space_last")  # the space starts the right piece / ends the left
PROBE_TEXTS = (
    "The quick brown fox jumps over the lazy dog, again and again.",
    "numbers 12 345 6.78 and punctuation: (yes) [no] {maybe} -- end",
    "café naïve Zürich 東京 北京 Ελλάδα emoji 😀 👍🏽 done",
    "Mixed CamelCase snake_case https://example.com/a?b=c end.",
    "tabs\tnew\nlines and  two  spaces kept whole",
)


def split_at_spaces(text: str, style: str, limit: int = PIECE_CHARS) -> list[str]:
    """`text` in pieces of at most about `limit` characters, cut at the last single space
    before each limit. A stretch of more than `limit` characters without one stays whole."""
    pieces: list[str] = []
    start = 0
    while len(text) - start > limit:
        cut = _last_cut(text, start, start + limit)
        if cut is None:
            match = _CUT.search(text, start + limit)
            if match is None:
                break
            cut = match.start()
        end = cut if style == "space_first" else cut + 1
        pieces.append(text[start:end])
        start = end
    pieces.append(text[start:])
    return pieces


def _last_cut(text: str, start: int, end: int) -> int | None:
    position = text.rfind(" ", start + 1, end)
    while position > start:
        if not text[position - 1].isspace() and not text[position + 1].isspace():
            return position
        position = text.rfind(" ", start + 1, position)
    return None


def cut_style(encode: Callable[[list[str]], list[list[int]]]) -> str | None:
    """The cut style that keeps the ids of every probe text at each of its cuts, or None."""
    for style in CUT_STYLES:
        if all(_keeps_ids(encode, text, style) for text in PROBE_TEXTS):
            return style
    return None


def _keeps_ids(encode: Callable[[list[str]], list[list[int]]], text: str, style: str) -> bool:
    cuts = [m.start() + (style == "space_last") for m in _CUT.finditer(text)]
    pieces = [piece for cut in cuts for piece in (text[:cut], text[cut:])]
    whole, *parts = encode([text, *pieces])
    return all([*parts[2 * index], *parts[2 * index + 1]] == whole for index in range(len(cuts)))


def pieces_of(texts: Sequence[str], style: str | None) -> tuple[list[str], list[int]]:
    """Every document's pieces in order, and how many pieces each document has."""
    pieces: list[str] = []
    counts: list[int] = []
    for text in texts:
        cut = [text] if style is None or len(text) <= LONG_CHARS else split_at_spaces(text, style)
        pieces.extend(cut)
        counts.append(len(cut))
    return pieces, counts
