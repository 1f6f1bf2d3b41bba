"""A generation request's settings and their allowed values. Torch-free: the export stage checks
its recipe's defaults with it before anything runs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class GenerationParams:
    """One request's decoding settings.

    Sampling applies, like Hugging Face: repetition penalty, temperature, top-k, top-p, then a
    draw. `top_k == 1` or `temperature == 0` is greedy (NeMo's convention). With
    `beam_width > 1` the search is beam search and temperature, top-k, top-p and the seed are
    ignored; the repetition penalty still applies. Stop words are looked for in the generated
    text only, not across the prompt's end.
    """

    tokens_to_generate: int = 32
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    repetition_penalty: float = 1.0
    random_seed: int | None = None
    stop_words: tuple[str, ...] = ()
    beam_width: int = 1
    # Beam search: a hypothesis scores its log-probability sum x length^length_penalty, so a
    # larger value prefers shorter ones (0: the plain sum; -1: the mean log-probability).
    length_penalty: float = 0.0
    # Beam search: each step, the k-th best continuation of a beam (k from 0) loses
    # beam_search_diversity_rate x k from its score, so beams of other parents survive.
    beam_search_diversity_rate: float = 0.0

    def check(self) -> None:
        """Raise ValueError naming the first bad field, its value and what it may be."""
        for name, ok, allowed in self._rules():
            if not ok:
                value = getattr(self, name)
                raise ValueError(f"{name}: {value!r} is not allowed; expected {allowed}")

    def _rules(self) -> list[tuple[str, bool, str]]:
        seed = self.random_seed
        words = self.stop_words
        return [
            ("tokens_to_generate", _is_int(self.tokens_to_generate, 1), "an integer >= 1"),
            ("temperature", _is_real(self.temperature, 0.0), "a number >= 0 (0 is greedy)"),
            ("top_k", _is_int(self.top_k, 0), "an integer >= 0 (0 disables, 1 is greedy)"),
            (
                "top_p",
                _is_real(self.top_p, 0.0) and self.top_p <= 1.0,
                "a number in [0, 1] (0 disables)",
            ),
            (
                "repetition_penalty",
                _is_real(self.repetition_penalty, 0.0) and self.repetition_penalty > 0,
                "a number > 0 (1 disables)",
            ),
            (
                "random_seed",
                seed is None or (_is_int(seed, 0) and seed <= MAX_SEED),
                f"null or an integer in [0, {MAX_SEED}]",
            ),
            (
                "stop_words",
                not isinstance(words, str)
                and isinstance(words, Sequence)
                and all(isinstance(w, str) and w for w in words),
                "a list of non-empty strings",
            ),
            ("beam_width", _is_int(self.beam_width, 1), "an integer >= 1 (1 disables)"),
            ("length_penalty", _is_real(self.length_penalty, -math.inf), "a finite number"),
            (
                "beam_search_diversity_rate",
                _is_real(self.beam_search_diversity_rate, 0.0),
                "a number >= 0 (0 disables)",
            ),
        ]

    @property
    def greedy(self) -> bool:
        return self.top_k == 1 or self.temperature == 0


def _is_int(value: object, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_real(value: object, low: float) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= low
    )
