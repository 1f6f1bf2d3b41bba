"""The `language` step: identify each document's language, keep the wanted ones.

The model is the user's fastText file (lid.176.bin, GlotLID's model.bin, or one trained on
their own labels), or, when none is named, the langid.py model that py3langid ships (97
languages, ISO 639-1 codes). Its codes are the model's own: `en` for lid.176 and langid.py,
`eng_Latn` for GlotLID. The language and its score go into the document's meta, where the
write step splits the output by language.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launcher_scripts.config.checks import require_open_fraction
from launcher_scripts.curation.document import Document
from launcher_scripts.curation.step import LANGUAGE, CurationStep, DocumentStep, Exists, register
from launcher_scripts.errors import ConfigError

FASTTEXT_PREFIX = "__label__"


def _check(section: Any, key: str, exists: Exists) -> None:
    model = section.get("model")
    if model is not None and not exists(Path(str(model))):
        raise ConfigError(
            f"{key}.model",
            f"{model} does not exist",
            "Give the path of a fastText language-ID model (e.g. lid.176.bin), or null for "
            "the langid.py model py3langid ships",
        )
    languages = section.get("languages")
    if languages is not None and (
        isinstance(languages, str) or not all(isinstance(code, str) for code in languages)
    ):
        raise ConfigError(
            f"{key}.languages", f"{languages!r} is not a list of codes", "Give e.g. [en,de]"
        )
    require_open_fraction(f"{key}.min_score", section.get("min_score"))


class FastTextIdentifier:
    def __init__(self, path: str) -> None:
        import fasttext

        self.model = fasttext.load_model(path)

    def __call__(self, text: str) -> tuple[str, float]:
        # fastText reads one line: its predict refuses newlines.
        labels, scores = self.model.predict(text.replace("\n", " "), k=1)
        return labels[0].removeprefix(FASTTEXT_PREFIX), float(scores[0])


class LangidIdentifier:
    def __init__(self) -> None:
        from py3langid.langid import MODEL_DIR, MODEL_FILE, LanguageIdentifier

        self.model = LanguageIdentifier.from_modelpath(MODEL_DIR / MODEL_FILE, norm_probs=True)

    def __call__(self, text: str) -> tuple[str, float]:
        code, score = self.model.classify(text)
        return str(code), float(score)


class LanguageFilter:
    def __init__(self, section: Any) -> None:
        model = section.get("model")
        self.identify = FastTextIdentifier(str(model)) if model else LangidIdentifier()
        languages = section.get("languages")
        self.languages = None if languages is None else frozenset(str(c) for c in languages)
        self.min_score = float(section.min_score)

    def __call__(self, doc: Document) -> str | None:
        code, score = self.identify(doc.text)
        doc.meta[LANGUAGE], doc.meta["language_score"] = code, round(score, 4)
        if score < self.min_score:
            return "language_score_below_min"
        if self.languages is not None and code not in self.languages:
            return "language_not_wanted"
        return None


def _build(section: Any, work: Path) -> DocumentStep:
    return LanguageFilter(section)


register(
    CurationStep(
        name="language",
        summary="language identification (a fastText model or langid.py); unwanted removed",
        check=_check,
        inputs=lambda section: tuple(str(m) for m in [section.get("model")] if m),
        prepare=None,
        build=_build,
        provides=(LANGUAGE, "language_score"),
    )
)
