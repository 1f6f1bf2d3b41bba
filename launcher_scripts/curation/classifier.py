"""The `classifier` step: a fastText quality classifier scores each document; those whose
probability of the positive label is below the threshold are removed (the reference's
classifier-based filtering, GPT-3's method: trained on a high-quality reference corpus as
positive and raw crawl as negative examples).

The model is the user's (a fastText .bin whose labels include `label`), or, when none is
named, trained in the preparation job from the recipe's positive and negative example files
(JSONL with the text under `text_key`, or plain text, one document per line).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from launcher_scripts.config.checks import require_int, require_open_fraction
from launcher_scripts.curation.document import Document
from launcher_scripts.curation.step import (
    CurationStep,
    DocumentStep,
    Exists,
    register,
    require_files,
)
from launcher_scripts.errors import ConfigError, JobError
from launcher_scripts.files import replaced_file

TRAINED = "classifier/quality.bin"
NEGATIVE = "low"
EXAMPLE_SUFFIXES = (".jsonl", ".jsonl.gz", ".txt", ".txt.gz")


def _examples(section: Any, name: str) -> tuple[str, ...]:
    return tuple(str(f) for f in section.get(name) or ())


def _check(section: Any, key: str, exists: Exists) -> None:
    model = section.get("model")
    if model is not None:
        if not exists(Path(str(model))):
            raise ConfigError(
                f"{key}.model",
                f"{model} does not exist",
                "Give a fastText .bin, or null to train one",
            )
    else:
        for name in ("positive", "negative"):
            files = _examples(section, name)
            if not files:
                raise ConfigError(
                    f"{key}.{name}",
                    "is empty and no model is given",
                    f"Name {name} example files (JSONL or text), or set {key}.model",
                )
            require_files(f"{key}.{name}", files, exists, EXAMPLE_SUFFIXES)
        require_int(f"{key}.epochs", section.get("epochs"))
        require_int(f"{key}.word_ngrams", section.get("word_ngrams"))
    label = section.get("label")
    if not isinstance(label, str) or not label or " " in label:
        raise ConfigError(f"{key}.label", f"{label!r} is not a label", "Give one word, e.g. hq")
    require_open_fraction(f"{key}.threshold", section.get("threshold"))


def _texts(path: str, text_key: str) -> Iterator[str]:
    import gzip

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as stream:  # type: ignore[operator]
        for number, line in enumerate(stream, 1):
            if not line.strip():
                continue
            if ".jsonl" in path:
                try:
                    yield str(json.loads(line)[text_key])
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise JobError(
                        f"{path}:{number}: not a JSON record with {text_key!r}"
                    ) from None
            else:
                yield line


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _prepare(section: Any, work: Path) -> None:
    if section.get("model") is not None:
        return
    import fasttext

    text_key, label = str(section.get("text_key") or "text"), str(section.label)
    lines = [
        f"__label__{name} {_one_line(text)}"
        for files, name in (
            (_examples(section, "positive"), label),
            (_examples(section, "negative"), NEGATIVE),
        )
        for path in files
        for text in _texts(path, text_key)
    ]
    random.Random(0).shuffle(lines)
    target = work / TRAINED
    target.parent.mkdir(parents=True, exist_ok=True)
    training = target.with_name("training.txt")
    training.write_text("\n".join(lines) + "\n", encoding="utf-8")
    model = fasttext.train_supervised(
        str(training),
        epoch=int(section.epochs),
        wordNgrams=int(section.word_ngrams),
        verbose=0,
        thread=1,  # one thread: the same model from the same examples
        seed=0,
    )
    with replaced_file(target) as temporary:
        model.save_model(str(temporary))
    print(f"classifier: trained on {len(lines):,} examples, saved {target}", flush=True)


class QualityClassifier:
    def __init__(self, section: Any, work: Path) -> None:
        import fasttext

        path = section.get("model") or work / TRAINED
        self.model = fasttext.load_model(str(path))
        self.label = f"__label__{section.label}"
        if self.label not in self.model.get_labels():
            raise JobError(
                f"data_curation.classifier.label: {section.label!r} is not a label of {path} "
                f"(it has {', '.join(self.model.get_labels())})"
            )
        self.threshold = float(section.threshold)

    def __call__(self, doc: Document) -> str | None:
        labels, scores = self.model.predict(_one_line(doc.text), k=-1)
        score = float(dict(zip(labels, scores, strict=True)).get(self.label, 0.0))
        doc.meta["quality_score"] = round(score, 4)
        return "quality_score_below_threshold" if score < self.threshold else None


def _build(section: Any, work: Path) -> DocumentStep:
    return QualityClassifier(section, work)


register(
    CurationStep(
        name="classifier",
        summary="a fastText quality classifier's score below the threshold removed",
        check=_check,
        inputs=lambda s: (*_examples(s, "positive"), *_examples(s, "negative")),
        prepare=_prepare,
        build=_build,
        provides=("quality_score",),
    )
)
