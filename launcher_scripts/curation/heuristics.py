"""The `heuristics` step: a chain of rule-based quality filters, each with its thresholds.

The Gopher quality and repetition rules, C4's and FineWeb's come from datatrove, whose
implementations the FineWeb work tuned and measured; they read words through a regex word
splitter here (datatrove's default English one needs NLTK's punkt data, a download). The URL
rule is this launcher's. A rule whose section is null is off; every key of a section is one
of the rule's parameters, and the ratios and fractions among them lie in (0, 1).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher_scripts.config.checks import require_open_fraction
from launcher_scripts.config.schema import suggestion
from launcher_scripts.curation.document import Document
from launcher_scripts.curation.step import CurationStep, DocumentStep, Exists, register
from launcher_scripts.errors import ConfigError

_WORDS = re.compile(r"\w+|[^\w\s]+")
_SENTENCE_ENDS = re.compile(r"(?<=[.!?])\s+")
_URL = re.compile(r"^(?:https?://|www\.)\S+", re.IGNORECASE)


@dataclass(frozen=True)
class Rule:
    """One filter: the parameters a recipe may set (with the published defaults), which of
    them are fractions, and how a job makes it (a callable: Document -> reason or None)."""

    parameters: dict[str, Any]
    fractions: tuple[str, ...]
    make: Callable[[dict[str, Any]], Callable[[Document], str | None]]


def word_splitter() -> Any:
    """datatrove's WordTokenizer over regular expressions (the bench hands it to datatrove too)."""
    from datatrove.utils.word_tokenizers import WordTokenizer

    class RegexWords(WordTokenizer):
        """Words and runs of punctuation; sentences end at . ! or ? and a space."""

        def word_tokenize(self, text: str) -> list[str]:
            return _WORDS.findall(text)

        def sent_tokenize(self, text: str) -> list[str]:
            return [s for s in _SENTENCE_ENDS.split(text) if s.strip()]

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            spans, start = [], 0
            for match in _SENTENCE_ENDS.finditer(text):
                spans.append((start, match.start()))
                start = match.end()
            return [*spans, (start, len(text))] if start < len(text) else spans

    return RegexWords("en")


def _datatrove(class_name: str) -> Callable[[dict[str, Any]], Callable[[Document], str | None]]:
    def make(values: dict[str, Any]) -> Callable[[Document], str | None]:
        from datatrove.data import Document as DatatroveDocument
        from datatrove.pipeline import filters

        rule = getattr(filters, class_name)(language=word_splitter(), **values)

        def apply(doc: Document) -> str | None:
            theirs = DatatroveDocument(text=doc.text, id=doc.id)
            verdict = rule.filter(theirs)
            doc.text = theirs.text  # C4's rule drops lines it judges boilerplate
            if verdict is True:
                return None
            return verdict[1] if isinstance(verdict, tuple) else class_name

        return apply

    return make


def _url_ratio(values: dict[str, Any]) -> Callable[[Document], str | None]:
    limit = float(values["max_url_word_ratio"])

    def apply(doc: Document) -> str | None:
        words = doc.text.split()
        urls = sum(1 for word in words if _URL.match(word))
        return "too_many_urls" if words and urls / len(words) > limit else None

    return apply


RULES: dict[str, Rule] = {
    "gopher_quality": Rule(
        {
            "min_doc_words": 50,
            "max_doc_words": 100000,
            "min_avg_word_length": 3,
            "max_avg_word_length": 10,
            "max_symbol_word_ratio": 0.1,
            "max_bullet_lines_ratio": 0.9,
            "max_ellipsis_lines_ratio": 0.3,
            "max_non_alpha_words_ratio": 0.8,
            "min_stop_words": 2,
            "stop_words": None,
        },
        (
            "max_symbol_word_ratio",
            "max_bullet_lines_ratio",
            "max_ellipsis_lines_ratio",
            "max_non_alpha_words_ratio",
        ),
        _datatrove("GopherQualityFilter"),
    ),
    "gopher_repetition": Rule(
        {
            "dup_line_frac": 0.3,
            "dup_para_frac": 0.3,
            "dup_line_char_frac": 0.2,
            "dup_para_char_frac": 0.2,
            "top_n_grams": [[2, 0.2], [3, 0.18], [4, 0.16]],
            "dup_n_grams": [[5, 0.15], [6, 0.14], [7, 0.13], [8, 0.12], [9, 0.11], [10, 0.10]],
        },
        ("dup_line_frac", "dup_para_frac", "dup_line_char_frac", "dup_para_char_frac"),
        _datatrove("GopherRepetitionFilter"),
    ),
    "c4_quality": Rule(
        {
            "split_paragraph": True,
            "remove_citations": True,
            "filter_no_terminal_punct": True,
            "min_num_sentences": 5,
            "min_words_per_line": 3,
            "max_word_length": 1000,
            "filter_lorem_ipsum": True,
            "filter_javascript": True,
            "filter_curly_bracket": True,
            "filter_policy": True,
        },
        (),
        _datatrove("C4QualityFilter"),
    ),
    "fineweb_quality": Rule(
        {
            "line_punct_thr": 0.12,
            "line_punct_exclude_zero": False,
            "short_line_thr": 0.67,
            "short_line_length": 30,
            "char_duplicates_ratio": 0.01,
            "new_line_ratio": 0.3,
        },
        ("line_punct_thr", "short_line_thr", "char_duplicates_ratio", "new_line_ratio"),
        _datatrove("FineWebQualityFilter"),
    ),
    "url_ratio": Rule({"max_url_word_ratio": 0.2}, ("max_url_word_ratio",), _url_ratio),
}


def rule_values(name: str, section: Any, key: str) -> dict[str, Any]:
    """The rule's parameters: the recipe's over the defaults, each checked."""
    rule = RULES[name]
    given = (
        OmegaConf.to_container(section, resolve=True)
        if isinstance(section, DictConfig)
        else section
    )
    if not isinstance(given, dict):
        raise ConfigError(key, f"{given!r} is not a section", "Give {parameter: value} or null")
    unknown = sorted(set(given) - set(rule.parameters))
    if unknown:
        raise ConfigError(
            f"{key}.{unknown[0]}",
            "is not a parameter of this rule",
            _meant(key, unknown[0], rule.parameters) or f"Use: {', '.join(rule.parameters)}",
        )
    values = {**rule.parameters, **given}
    for parameter in rule.fractions:
        require_open_fraction(f"{key}.{parameter}", values[parameter])
    for parameter in ("top_n_grams", "dup_n_grams"):
        for index, pair in enumerate(values.get(parameter) or ()):
            if len(pair) != 2 or not isinstance(pair[0], int) or pair[0] < 1:
                raise ConfigError(
                    f"{key}.{parameter}[{index}]",
                    f"{pair!r} is not [n, fraction]",
                    "Give e.g. [2, 0.2]",
                )
            require_open_fraction(f"{key}.{parameter}[{index}][1]", pair[1])
    values = {
        k: tuple(map(tuple, v)) if k in ("top_n_grams", "dup_n_grams") else v
        for k, v in values.items()
    }
    return values


def _meant(prefix: str, name: str, known: Iterable[str]) -> str:
    close = suggestion(name, dict.fromkeys(known))
    return f"Did you mean {prefix}.{close}?" if close else ""


def _check(section: Any, key: str, exists: Exists) -> None:
    rules = section.get("rules")
    if not rules:
        raise ConfigError(f"{key}.rules", "names no rule", f"Give some of: {', '.join(RULES)}")
    for name, values in rules.items():
        if name not in RULES:
            raise ConfigError(
                f"{key}.rules.{name}",
                "is not a rule",
                _meant(f"{key}.rules", name, RULES) or f"Use some of: {', '.join(RULES)}",
            )
        if values is not None:
            rule_values(name, values, f"{key}.rules.{name}")


class HeuristicChain:
    def __init__(self, section: Any) -> None:
        self.rules = [
            (name, RULES[name].make(rule_values(name, values, name)))
            for name, values in section.rules.items()
            if values is not None
        ]

    def __call__(self, doc: Document) -> str | None:
        for name, rule in self.rules:
            reason = rule(doc)
            if reason is not None:
                return f"{name}.{reason}"
        return None


def _build(section: Any, work: Path) -> DocumentStep:
    return HeuristicChain(section)


register(
    CurationStep(
        name="heuristics",
        summary="rule-based quality filters (Gopher, C4, FineWeb, URL ratio)",
        check=_check,
        inputs=lambda section: (),
        prepare=None,
        build=_build,
    )
)
