"""The preference converter (jobs/data_prep/preference_convert.py): Anthropic HH-RLHF,
UltraFeedback binarised and Stack Exchange preferences become the prompt/chosen/rejected JSON
lines that reward-model training and DPO read, from small files made here, in process. Bad
records are counted and reported by line; too many fail the job in one line and keep the
previous output."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from launcher_scripts.jobs.data_prep.preference_convert import main, preference_problem


def write(path: Path, records: list[Any]) -> Path:
    text = "".join(json.dumps(record) + "\n" for record in records)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


HH_GOOD = {
    "chosen": "\n\nHuman: What is 2+2?\n\nAssistant: Four.\n\nHuman: And 3+3?\n\nAssistant: Six.",
    "rejected": "\n\nHuman: What is 2+2?\n\nAssistant: Four.\n\nHuman: And 3+3?\n\nAssistant: No.",
}


def test_hh_rlhf_conversations_become_turns_and_two_answers(tmp_path: Path) -> None:
    other_start = dict(HH_GOOD, rejected="\n\nHuman: Hi\n\nAssistant: No.")
    source = write(tmp_path / "hh.jsonl.gz", [HH_GOOD] * 199 + [other_start])
    output = tmp_path / "out.jsonl"
    assert main(["hh-rlhf", "--input", str(source), "--output", str(output)]) == 0
    records = read(output)
    assert len(records) == 199
    assert records[0] == {
        "prompt": [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "Four."},
            {"role": "user", "content": "And 3+3?"},
        ],
        "chosen": "Six.",
        "rejected": "No.",
    }


def test_ultrafeedback_keeps_the_shared_turns_and_the_scores(tmp_path: Path) -> None:
    def conversation(answer: str) -> list[dict[str, str]]:
        return [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": answer},
        ]

    good = {
        "prompt": "Name a colour.",
        "chosen": conversation("Blue."),
        "rejected": conversation("Seven."),
        "score_chosen": 9.0,
        "score_rejected": 2.5,
    }
    source = write(tmp_path / "uf.jsonl", [good])
    output = tmp_path / "out.jsonl"
    assert main(["ultrafeedback", "--input", str(source), "--output", str(output)]) == 0
    assert read(output) == [
        {
            "prompt": [{"role": "user", "content": "Name a colour."}],
            "chosen": "Blue.",
            "rejected": "Seven.",
            "score_chosen": 9.0,
            "score_rejected": 2.5,
        }
    ]


def test_stack_exchange_pairs_the_best_answer_with_the_lowest(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    question = {
        "question": "How do I sort a list?",
        "answers": [
            {"text": "Use sorted().", "pm_score": 5},
            {"text": "You cannot.", "pm_score": 1},
            {"text": "Write a bubble sort.", "pm_score": 3},
        ],
    }
    tie = {
        "question": "Tabs?",
        "answers": [{"text": "Yes.", "pm_score": 2}, {"text": "No.", "pm_score": 2}],
    }
    source = write(tmp_path / "se.jsonl", [question, tie])
    output = tmp_path / "out.jsonl"
    command = ["stack-exchange", "--input", str(source), "--output", str(output)]
    assert main([*command, "--max-pairs", "2"]) == 0
    pairs = [(r["chosen"], r["rejected"], r["score_rejected"]) for r in read(output)]
    assert pairs == [
        ("Use sorted().", "You cannot.", 1),
        ("Use sorted().", "Write a bubble sort.", 3),
    ]
    assert "1 questions without a pair" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        ({"prompt": "Q", "chosen": "A"}, "'rejected' missing"),
        ({"prompt": "Q", "chosen": "A ", "rejected": " A"}, "the same text"),
        ({"chosen": "A", "rejected": "B"}, "'prompt' missing"),
        (
            {"prompt": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
             "chosen": "A", "rejected": "B"},
            "must end with a user turn",
        ),
        ({"prompt": [{"role": "bot", "content": "Q"}], "chosen": "A", "rejected": "B"}, "role"),
    ],
)  # fmt: skip
def test_a_pair_that_prefers_nothing_or_lacks_a_part_is_named(record: Any, problem: str) -> None:
    found = preference_problem(record)
    assert found is not None and problem in found, found
    assert preference_problem({"prompt": "Q", "chosen": "A", "rejected": "B"}) is None


def test_too_many_bad_records_fail_in_one_line_and_keep_the_old_output(
    tmp_path: Path,
    capsys,  # type: ignore[no-untyped-def]
) -> None:
    same = {"chosen": HH_GOOD["chosen"], "rejected": HH_GOOD["chosen"]}
    source = write(tmp_path / "hh.jsonl", [HH_GOOD, same, "not an object", {"chosen": 3}])
    output = tmp_path / "out.jsonl"
    output.write_text("the previous conversion\n")
    assert main(["hh-rlhf", "--input", str(source), "--output", str(output)]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "3 of 4 records" in errors[0], err
    assert f"{source}:2: 'chosen' and 'rejected' are the same text" in err
    assert output.read_text() == "the previous conversion\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.jsonl")]
