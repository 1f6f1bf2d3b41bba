"""The validation metric of a tuning stage (`model.data.validation_ds.metric`, NeMo's keys): how
the greedy answers to the validation and test records are scored.

    name          loss (no answers generated) | exact_string_match (the stripped answer equals
                  one of the record's answers) | accuracy | f1 (the answer as a class label)
    average       micro | macro, for accuracy and f1 (null: micro). micro: over the records;
                  macro: the mean over the classes of each class's recall (accuracy) or F1
    num_classes   the number of classes (null: as many as are found)
    class_labels  the classes' labels; an answer outside them is wrong for every class
    labels_are_strings  NeMo's: the labels are text; true asks for class_labels

As NeMo's GLUE-style recipes have it. Torch-free: the stage checks the section, the job scores.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from launcher_scripts.errors import ConfigError

NAMES = ("loss", "exact_string_match", "accuracy", "f1")
GENERATED = ("exact_string_match", "accuracy", "f1")  # the metrics that generate answers
AVERAGES = ("micro", "macro")


@dataclass(frozen=True)
class AnswerMetric:
    name: str
    average: str = "micro"
    num_classes: int | None = None
    class_labels: tuple[str, ...] | None = None

    @property
    def generates(self) -> bool:
        return self.name in GENERATED


def read_metric(section: Mapping[str, Any] | None, key: str) -> AnswerMetric:
    """`section`: the validation_ds.metric section; `key` its dotted name for errors."""
    section = section or {}
    name = str(section.get("name") or "loss")
    if name not in NAMES:
        raise ConfigError(
            f"{key}.name", f"{name!r} is not computed here", f"Use {' | '.join(NAMES)}"
        )
    average = section.get("average") or "micro"
    if average not in AVERAGES:
        raise ConfigError(f"{key}.average", f"{average!r} is not valid", "Use micro or macro")
    classes = section.get("num_classes")
    if classes is not None and (
        isinstance(classes, bool) or not isinstance(classes, int) or classes < 2
    ):
        raise ConfigError(f"{key}.num_classes", f"{classes!r} is not 2 or more", "Fix it")
    labels = section.get("class_labels")
    if labels is not None:
        if isinstance(labels, str) or not isinstance(labels, Sequence) or not labels:
            raise ConfigError(f"{key}.class_labels", f"{labels!r} is not a list", "e.g. [yes,no]")
        labels = tuple(str(label).strip() for label in labels)
        if len(set(labels)) != len(labels):
            raise ConfigError(f"{key}.class_labels", "holds a label twice", "List each once")
        if classes is not None and classes != len(labels):
            raise ConfigError(
                f"{key}.num_classes",
                f"is {classes} but class_labels lists {len(labels)}",
                "Make them agree, or leave num_classes null",
            )
    if section.get("labels_are_strings") and labels is None:
        raise ConfigError(
            f"{key}.class_labels", "is null but labels_are_strings is true", "List the labels"
        )
    if name not in ("accuracy", "f1"):
        for extra in ("num_classes", "class_labels"):
            if section.get(extra) is not None:
                raise ConfigError(
                    f"{key}.{extra}",
                    f"is set but metric {name} scores no classes",
                    f"Set {key}.name to accuracy or f1, or {extra} to null",
                )
    return AnswerMetric(name, str(average), classes, labels)


class TooManyClasses(ValueError):
    """The answers' labels hold more classes than num_classes says."""


def score(metric: AnswerMetric, pairs: Sequence[tuple[str, str]]) -> float:
    """accuracy or f1 of (predicted answer, label) pairs, both stripped."""
    pairs = [(pred.strip(), label.strip()) for pred, label in pairs]
    classes = list(metric.class_labels or sorted({label for _, label in pairs}))
    if metric.num_classes is not None and len(classes) > metric.num_classes:
        raise TooManyClasses(
            f"the labels hold {len(classes)} classes but num_classes is {metric.num_classes}"
        )
    if metric.name == "accuracy" and metric.average == "micro":
        return sum(pred == label for pred, label in pairs) / len(pairs)
    true_pos = {c: 0 for c in classes}
    false_pos = {c: 0 for c in classes}
    false_neg = {c: 0 for c in classes}
    for pred, label in pairs:
        if pred == label and label in true_pos:
            true_pos[label] += 1
            continue
        if label in false_neg:
            false_neg[label] += 1
        if pred in false_pos:
            false_pos[pred] += 1
    if metric.name == "accuracy":  # macro: the mean per-class recall (balanced accuracy)
        seen = [c for c in classes if true_pos[c] + false_neg[c]]
        return sum(true_pos[c] / (true_pos[c] + false_neg[c]) for c in seen) / len(seen)
    if metric.average == "micro":
        tp, fp, fn = (sum(d.values()) for d in (true_pos, false_pos, false_neg))
        return _f1(tp, fp, fn)
    return sum(_f1(true_pos[c], false_pos[c], false_neg[c]) for c in classes) / len(classes)


def _f1(tp: int, fp: int, fn: int) -> float:
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0
