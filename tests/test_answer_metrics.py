"""Classification metrics of the tuning stages' generated answers (validation_ds.metric: NeMo's
accuracy and f1 with average, num_classes, class_labels), against scikit-learn's."""

from __future__ import annotations

import random

import pytest
from sklearn.metrics import accuracy_score, balanced_accuracy_score, f1_score

from launcher_scripts.errors import ConfigError
from launcher_scripts.recipes.answer_metrics import (
    AnswerMetric,
    TooManyClasses,
    read_metric,
    score,
)

CLASSES = ("positive", "negative", "neutral", "mixed")


def answers(seed: int) -> tuple[list[str], list[str]]:
    """Labels, and predictions that are often right, sometimes another class, sometimes none."""
    draw = random.Random(seed)
    labels = [draw.choice(CLASSES) for _ in range(200)]
    preds = [
        label if draw.random() < 0.6 else draw.choice([*CLASSES, "no idea"]) for label in labels
    ]
    return labels, preds


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_scores_are_scikit_learns(seed: int) -> None:
    labels, preds = answers(seed)
    pairs = list(zip(preds, labels, strict=True))
    classes = sorted(set(labels))

    def ours(name: str, average: str) -> float:
        return score(AnswerMetric(name, average), pairs)

    assert ours("accuracy", "micro") == pytest.approx(accuracy_score(labels, preds))
    assert ours("accuracy", "macro") == pytest.approx(balanced_accuracy_score(labels, preds))
    for average in ("micro", "macro"):
        theirs = f1_score(labels, preds, labels=classes, average=average, zero_division=0)
        assert ours("f1", average) == pytest.approx(theirs)


def test_class_labels_count_a_class_no_answer_has() -> None:
    pairs = [("yes", "yes"), ("no", "yes")]
    with_labels = AnswerMetric("f1", "macro", class_labels=("yes", "no", "maybe"))
    # F1 of yes: 2/3; of no: 0 (one false positive); of maybe: 0 (never a label nor an answer).
    assert score(with_labels, pairs) == pytest.approx((2 / 3) / 3)
    assert score(AnswerMetric("f1", "macro"), pairs) == pytest.approx(2 / 3)  # yes alone


def test_more_classes_than_num_classes_is_an_error() -> None:
    with pytest.raises(TooManyClasses, match="3 classes but num_classes is 2"):
        score(AnswerMetric("accuracy", num_classes=2), [("a", "a"), ("b", "b"), ("c", "c")])


KEY = "fine_tuning.model.data.validation_ds.metric"


@pytest.mark.parametrize(
    ("section", "key", "says"),
    [
        ({"name": "rouge"}, "name", "not computed here"),
        ({"name": "f1", "average": "weighted"}, "average", "micro or macro"),
        ({"name": "f1", "num_classes": 1}, "num_classes", "not 2 or more"),
        ({"name": "f1", "num_classes": 3, "class_labels": ["a", "b"]}, "num_classes", "lists 2"),
        ({"name": "accuracy", "class_labels": ["a", "a"]}, "class_labels", "twice"),
        ({"name": "accuracy", "labels_are_strings": True}, "class_labels", "labels_are_strings"),
        ({"name": "loss", "num_classes": 2}, "num_classes", "scores no classes"),
    ],
)
def test_a_bad_metric_section_is_one_line(section: dict, key: str, says: str) -> None:
    with pytest.raises(ConfigError) as error:
        read_metric(section, KEY)
    assert error.value.key == f"{KEY}.{key}" and says in str(error.value)
    assert len(str(error.value).splitlines()) == 1


def test_the_defaults_read_as_nemos_recipes_write_them() -> None:
    metric = read_metric({"name": "f1", "average": None, "num_classes": None}, KEY)
    assert metric == AnswerMetric("f1", "micro") and metric.generates
    assert not read_metric(None, KEY).generates  # loss
