"""The SFT recipes (data_preparation=sft/squad, sft/dolly): local SQuAD and Dolly files become
the JSON lines the fine-tuning and PEFT recipes read. End to end through main.py on the local
backend with tiny files made here; the converter's rules (answers, splits, bad records, atomic
outputs) also in process."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from launcher_scripts.config.compose import compose_config
from launcher_scripts.config.preflight import resolve
from launcher_scripts.errors import ConfigError
from launcher_scripts.jobs.data_prep import sft_convert
from launcher_scripts.stages import STAGES, StageContext
from tests.support.commands import run_main
from tests.support.http_site import Site

STAGE = "data_preparation"
PROGRAM = "launcher_scripts.jobs.data_prep.sft_convert"


def jsonl(records: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def prepare(tmp_path: Path, recipe: str, *overrides: str) -> Any:
    return run_main(
        f"stages=[{STAGE}]",
        f"{STAGE}=sft/{recipe}",
        f"data_dir={tmp_path / 'data'}",
        f"base_results_dir={tmp_path / 'results'}",
        *overrides,
    )


def output_of(result: Any) -> str:
    return result.stdout + result.stderr


def leftovers(folder: Path) -> list[str]:
    """Temporary files a conversion left behind (it must leave none)."""
    return sorted(path.name for path in folder.rglob(".*.tmp"))


# ---- SQuAD -------------------------------------------------------------------------------


def qa(qid: str, question: str, *answers: str) -> dict[str, Any]:
    return {
        "id": qid,
        "question": question,
        "answers": [{"text": text, "answer_start": 0} for text in answers],
    }


def squad(*articles: list[dict[str, Any]]) -> dict[str, Any]:
    """A SQuAD document; each article a list of (context, qas) paragraphs."""
    return {
        "version": "1.1",
        "data": [
            {"title": f"article {i}", "paragraphs": paragraphs}
            for i, paragraphs in enumerate(articles)
        ],
    }


SQUAD_TRAIN = squad(
    [
        {
            "context": "Paris is the capital of France.",
            "qas": [
                qa("t1", "What is the capital of France?", "Paris"),
                qa("t2", "Which country is Paris in?", "France"),
            ],
        },
        {
            "context": "Zürich liegt in der Schweiz.\nIt has a lake.",
            "qas": [
                qa("t3", "Where is Zürich?", "in der Schweiz"),
                qa("t4", "What is unanswerable here?"),  # no answers: skipped, counted
            ],
        },
    ],
    [{"context": "Water boils at 100 °C.", "qas": [qa("t5", "When does water boil?", "100 °C")]}],
)
SQUAD_DEV = squad(
    [
        {
            "context": "The Nile flows north.",
            "qas": [
                qa("d1", "Which way does the Nile flow?", "north", "north", "flows north"),
                qa("d2", "What flows north?", "The Nile"),
            ],
        }
    ]
)


def write_squad(tmp_path: Path, train: dict[str, Any], dev: dict[str, Any]) -> Path:
    folder = tmp_path / "data" / "squad_data" / "v1.1"
    folder.mkdir(parents=True)
    (folder / "train-v1.1.json").write_text(json.dumps(train), encoding="utf-8")
    (folder / "dev-v1.1.json").write_text(json.dumps(dev), encoding="utf-8")
    return folder


def test_squad_end_to_end(tmp_path: Path) -> None:
    folder = write_squad(tmp_path, SQUAD_TRAIN, SQUAD_DEV)
    result = prepare(tmp_path, "squad")
    assert result.returncode == 0, output_of(result)
    assert (folder / "train-v1.1_gpt.json").read_text(encoding="utf-8") == jsonl(
        [
            {
                "input": "Context: Paris is the capital of France. "
                "Question: What is the capital of France? Answer:",
                "output": "Paris",
            },
            {
                "input": "Context: Paris is the capital of France. "
                "Question: Which country is Paris in? Answer:",
                "output": "France",
            },
            {
                "input": "Context: Zürich liegt in der Schweiz.\nIt has a lake. "
                "Question: Where is Zürich? Answer:",
                "output": "in der Schweiz",
            },
            {
                "input": "Context: Water boils at 100 °C. Question: When does water boil? Answer:",
                "output": "100 °C",
            },
        ]
    )
    assert (folder / "dev-v1.1_gpt.json").read_text(encoding="utf-8") == jsonl(
        [
            {
                "input": "Context: The Nile flows north. "
                "Question: Which way does the Nile flow? Answer:",
                "output": "north",
                "original_answers": ["north", "north", "flows north"],
            },
            {
                "input": "Context: The Nile flows north. Question: What flows north? Answer:",
                "output": "The Nile",
                "original_answers": ["The Nile"],
            },
        ]
    )
    # T5's text to text: "question: ... context: ..." in, the first answer out, one line each
    # (a line break inside a context becomes a space).
    assert (folder / "train-v1.1_src.txt").read_text(encoding="utf-8").splitlines() == [
        "question: What is the capital of France? context: Paris is the capital of France.",
        "question: Which country is Paris in? context: Paris is the capital of France.",
        "question: Where is Zürich? context: Zürich liegt in der Schweiz. It has a lake.",
        "question: When does water boil? context: Water boils at 100 °C.",
    ]
    assert (folder / "train-v1.1_tgt.txt").read_text(encoding="utf-8").splitlines() == [
        "Paris", "France", "in der Schweiz", "100 °C",
    ]  # fmt: skip
    assert (folder / "dev-v1.1_tgt.txt").read_text(encoding="utf-8") == "north\nThe Nile\n"
    assert "4 questions written" in result.stdout
    assert "1 without answers skipped" in result.stdout
    assert leftovers(tmp_path / "data") == []


def test_xquad_languages_become_text_to_text_pairs(tmp_path: Path) -> None:
    folder = tmp_path / "data" / "squad_data" / "xquad"
    folder.mkdir(parents=True)
    for language, question in (("en", "Which way?"), ("de", "Wohin?")):
        document = squad([{"context": "Der Nil.", "qas": [qa("x", question, "Norden")]}])
        (folder / f"xquad.{language}.json").write_text(json.dumps(document), encoding="utf-8")
    result = prepare(tmp_path, "xquad", f"{STAGE}.languages=[en,de]")
    assert result.returncode == 0, output_of(result)
    assert (folder / "xquad.de_src.txt").read_text() == "question: Wohin? context: Der Nil.\n"
    assert (folder / "xquad.de_tgt.txt").read_text() == "Norden\n"
    assert (folder / "xquad.en_src.txt").read_text() == "question: Which way? context: Der Nil.\n"
    missing = prepare(tmp_path, "xquad", f"{STAGE}.languages=[en,hi]")
    assert missing.returncode == 2
    assert missing.stderr.startswith(f"error: {STAGE}.languages: {folder / 'xquad.hi.json'} ")


def test_text_to_text_pairs_are_what_the_t5_recipes_read() -> None:
    overrides = [
        f"{STAGE}=sft/squad", "fine_tuning=mt5/xquad", "data_dir=/data", "base_results_dir=/r",
    ]  # fmt: skip
    cfg = resolve(compose_config(overrides), [STAGE, "fine_tuning"])
    prep, data = cfg[STAGE], cfg.fine_tuning.model.data
    assert (data.train_ds.src_file_name, data.train_ds.tgt_file_name) == (
        prep.train_src_output,
        prep.train_tgt_output,
    )
    xquad = resolve(compose_config([f"{STAGE}=sft/xquad", "data_dir=/data"]), [STAGE])[STAGE]
    assert list(data.validation_ds.src_file_name) == [
        f"{xquad.xquad_dir}/xquad.{language}_src.txt" for language in xquad.languages
    ]


def test_squad_writes_what_the_tuning_recipes_read() -> None:
    groups = [STAGE, "fine_tuning", "peft", "evaluation"]
    overrides = [
        f"{STAGE}=sft/squad", "fine_tuning=gpt3/squad", "peft=gpt3/squad",
        "evaluation=peft_gpt3/squad", "data_dir=/data", "base_results_dir=/results",
    ]  # fmt: skip
    cfg = resolve(compose_config(overrides), groups)
    prep = cfg[STAGE]
    assert prep.train_output == "/data/squad_data/v1.1/train-v1.1_gpt.json"
    assert prep.dev_output == "/data/squad_data/v1.1/dev-v1.1_gpt.json"
    assert prep.train_file == "/data/squad_data/v1.1/train-v1.1.json"
    for group in ("fine_tuning", "peft"):
        data = cfg[group].model.data
        assert list(data.train_ds.file_names) == [prep.train_output]
        assert list(data.validation_ds.file_names) == [prep.dev_output]
        assert (data.train_ds.context_key, data.train_ds.label_key) == ("input", "output")
    assert list(cfg.evaluation.data.test_ds) == [prep.dev_output]


def test_squad_bad_questions_are_reported_and_fail_the_job(tmp_path: Path) -> None:
    train = squad(
        [
            {
                "context": "Some context.",
                "qas": [
                    qa("ok", "A question?", "an answer"),
                    {"id": "noq", "answers": [{"text": "x", "answer_start": 0}]},
                    qa("emptyanswer", "Another?", ""),
                ],
            },
            {"context": "", "qas": [qa("c", "Q?", "A")]},
        ]
    )
    folder = write_squad(tmp_path, train, SQUAD_DEV)
    result = prepare(tmp_path, "squad")
    assert result.returncode == 1, output_of(result)
    text = output_of(result)
    source = folder / "train-v1.1.json"
    assert f"{source}: 3 bad of 4 records" in text
    assert f"{source}: data[0].paragraphs[0].qas[1] (id noq): 'question' missing" in text
    assert f"{source}: data[0].paragraphs[0].qas[2] (id emptyanswer): answers[0] has no " in text
    assert f"{source}: data[0].paragraphs[1]: no 'context' text" in text
    assert "more than --max-bad-fraction 0.01" in text
    assert not (folder / "train-v1.1_gpt.json").exists()
    assert not (folder / "dev-v1.1_gpt.json").exists()  # the job stopped at the train file
    assert leftovers(tmp_path / "data") == []

    # The same file passes once the limit allows three bad records in four.
    result = prepare(tmp_path, "squad", f"{STAGE}.max_bad_fraction=0.75")
    assert result.returncode == 0, output_of(result)
    lines = (folder / "train-v1.1_gpt.json").read_text().splitlines()
    assert [json.loads(line)["output"] for line in lines] == ["an answer"]


def test_a_file_that_is_not_squad_is_one_line_and_keeps_the_old_output(tmp_path: Path) -> None:
    source, output = tmp_path / "train.json", tmp_path / "train_gpt.json"
    output.write_text("old\n")
    for content, problem in (
        ("{not json", "is not valid JSON"),
        ('{"version": "1.1"}', "has no top-level 'data' list"),
        (json.dumps(squad([{"context": "c", "qas": [qa("x", "q?")]}])), "no question with an"),
    ):
        source.write_text(content)
        code = sft_convert.main(["squad", "--input", str(source), "--output", str(output)])
        assert code == 1, problem
        assert output.read_text() == "old\n"
    assert leftovers(tmp_path) == []


# ---- Dolly -------------------------------------------------------------------------------


def dolly_record(i: int) -> dict[str, Any]:
    """Every third record has a context; every fourth a blank one; every fifth no category."""
    record: dict[str, Any] = {
        "instruction": f"  Instruction {i}\n",
        "context": f"Context {i}." if i % 3 == 0 else ("  \n" if i % 4 == 0 else ""),
        "response": f"Response {i}.",
        "category": "open_qa" if i % 2 else "closed_qa",
    }
    if i % 5 == 0:
        del record["category"]
    return record


def converted(i: int) -> dict[str, Any]:
    record = dolly_record(i)
    prompt = f"Instruction {i}"
    if i % 3 == 0:
        prompt = f"Context {i}.\n\n{prompt}"
    out = {"input": prompt, "output": f"Response {i}."}
    if "category" in record:
        out["category"] = record["category"]
    return out


def write_dolly(tmp_path: Path, count: int, bad_at: dict[int, str] | None = None) -> Path:
    """`count` good records, with the raw lines of `bad_at` inserted at those 1-based line
    numbers, and a blank line at the end (not a record)."""
    lines = [json.dumps(dolly_record(i)) for i in range(count)]
    for number, raw in sorted((bad_at or {}).items()):
        lines.insert(number - 1, raw)
    path = tmp_path / "data" / "dolly" / "databricks-dolly-15k.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_dolly_split_end_to_end(tmp_path: Path) -> None:
    bad = {4: "{not json", 9: json.dumps({"instruction": "no response"}), 12: "[1, 2]"}
    source = write_dolly(tmp_path, 40, bad)
    result = prepare(tmp_path, "dolly", f"{STAGE}.max_bad_fraction=0.1")
    assert result.returncode == 0, output_of(result)
    text = output_of(result)
    assert f"{source}: 3 bad of 43 records" in text
    assert f"{source}:4: not valid JSON" in text
    assert f"{source}:9: 'response' missing" in text
    assert f"{source}:12: not a JSON object" in text

    folder = source.parent
    names = ("train", "validation", "test")
    splits = {name: read_jsonl(folder / f"dolly_{name}.jsonl") for name in names}
    assert [len(splits[name]) for name in names] == [36, 2, 2]
    # Together the splits are every good record once; each keeps the input order.
    expected = [converted(i) for i in range(40)]
    for records in splits.values():
        positions = [expected.index(record) for record in records]
        assert positions == sorted(positions)
    merged = sorted((r for records in splits.values() for r in records), key=expected.index)
    assert merged == expected
    assert leftovers(tmp_path / "data") == []

    # The same seed gives the same files; another seed another deal.
    before = {name: (folder / f"dolly_{name}.jsonl").read_bytes() for name in names}
    again = prepare(tmp_path, "dolly", f"{STAGE}.max_bad_fraction=0.1")
    assert again.returncode == 0, output_of(again)
    assert {name: (folder / f"dolly_{name}.jsonl").read_bytes() for name in names} == before
    other = prepare(tmp_path, "dolly", f"{STAGE}.max_bad_fraction=0.1", f"{STAGE}.seed=7")
    assert other.returncode == 0, output_of(other)
    assert (folder / "dolly_validation.jsonl").read_bytes() != before["validation"]


def test_dolly_without_a_split_writes_one_file_in_order(tmp_path: Path) -> None:
    source = write_dolly(tmp_path, 12)
    result = prepare(tmp_path, "dolly", f"{STAGE}.split_fractions=null")
    assert result.returncode == 0, output_of(result)
    assert (source.parent / "dolly.jsonl").read_text(encoding="utf-8") == jsonl(
        [converted(i) for i in range(12)]
    )
    assert not (source.parent / "dolly_train.jsonl").exists()


def test_dolly_a_zero_fraction_split_is_not_written(tmp_path: Path) -> None:
    source = write_dolly(tmp_path, 10)
    result = prepare(
        tmp_path, "dolly", f"{STAGE}.split_fractions={{train: 0.8, validation: 0.2, test: 0}}"
    )
    assert result.returncode == 0, output_of(result)
    assert len(read_jsonl(source.parent / "dolly_train.jsonl")) == 8
    assert len(read_jsonl(source.parent / "dolly_validation.jsonl")) == 2
    assert not (source.parent / "dolly_test.jsonl").exists()


def test_dolly_too_many_bad_lines_fail_and_write_nothing(tmp_path: Path) -> None:
    source = write_dolly(tmp_path, 10, {2: '{"instruction": 5, "response": "r"}'})
    result = prepare(tmp_path, "dolly")
    assert result.returncode == 1, output_of(result)
    text = output_of(result)
    assert f"{source}:2: 'instruction' not a string" in text
    assert f"{source}: 1 of 11 records (9.09%) are bad, more than --max-bad-fraction 0.01" in text
    assert sorted(p.name for p in source.parent.iterdir()) == [source.name]


def test_dolly_rules_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [
        {"instruction": "I", "context": None, "response": " spaced ", "category": "c"},
        {"instruction": "I", "context": "ctx", "response": "r"},
        {"instruction": "I", "context": 3, "response": "r"},
        {"instruction": "I", "response": "r", "category": ["x"]},
        {"instruction": "\ud800", "response": "r"},
        {"instruction": " \n", "response": "r"},
    ]
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv = ["dolly", "--input", str(source), "--output", str(output)]
    assert sft_convert.main([*argv, "--max-bad-fraction", "0.6"]) == 1
    assert not output.exists()
    reported = capsys.readouterr().err
    for number, reason in (
        (3, "'context' not a string"),
        (4, "'category' not a string"),
        (5, "a text holds a lone surrogate"),
        (6, "'instruction' empty"),
    ):
        assert f"{source}:{number}: {reason}" in reported
    assert sft_convert.main([*argv, "--max-bad-fraction", "0.7"]) == 0
    assert output.read_text() == jsonl(
        [
            {"input": "I", "output": " spaced ", "category": "c"},
            {"input": "ctx\n\nI", "output": "r"},
        ]
    )


@pytest.mark.parametrize(
    ("total", "fractions", "sizes"),
    [
        (20, [0.9, 0.05, 0.05], [18, 1, 1]),
        (10, [0.9, 0.05, 0.05], [9, 1, 0]),  # one left over: the first of the tied remainders
        (3, [0.5, 0.5], [2, 1]),
        (7, [1.0], [7]),
        (0, [0.8, 0.2], [0, 0]),
        (101, [0.7, 0.2, 0.1], [71, 20, 10]),
    ],
)
def test_split_sizes_sum_to_the_records(
    total: int, fractions: list[float], sizes: list[int]
) -> None:
    assert sft_convert.split_sizes(total, fractions) == sizes
    assignment = sft_convert.assign_splits(total, fractions, seed=1)
    assert [assignment.count(index) for index in range(len(fractions))] == sizes
    assert sft_convert.assign_splits(total, fractions, seed=1) == assignment


def test_bad_split_arguments_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for split in (["train", "0.5", "a"], ["dev", "1", "a"], ["train", "x", "a"]):
        assert sft_convert.main(["dolly", "--input", "x", "--split", *split]) == 1
        assert capsys.readouterr().err.count("\n") == 1


# ---- preflight and dry runs --------------------------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "key"),
    [("squad", "train_file"), ("dolly", "input_file")],
)
def test_a_missing_input_is_a_one_line_error_before_anything_runs(
    recipe: str, key: str, tmp_path: Path
) -> None:
    result = prepare(tmp_path, recipe)
    assert result.returncode == 2, output_of(result)
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {STAGE}.{key}: ") and "does not exist" in line
    assert result.stdout == ""
    assert not (tmp_path / "results").exists() and not (tmp_path / "data").exists()


def test_the_dev_file_is_checked_too(tmp_path: Path) -> None:
    folder = write_squad(tmp_path, SQUAD_TRAIN, SQUAD_DEV)
    (folder / "dev-v1.1.json").unlink()
    result = prepare(tmp_path, "squad")
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: {STAGE}.dev_file: {folder / 'dev-v1.1.json'} ")


@pytest.mark.parametrize("recipe", ["squad", "dolly"])
def test_dry_run_lists_the_missing_inputs_and_writes_no_data(recipe: str, tmp_path: Path) -> None:
    result = prepare(tmp_path, recipe, "dry_run=true")
    assert result.returncode == 0, output_of(result)
    assert "not there yet" in result.stdout
    data = tmp_path / "data"
    expected = (
        data / "squad_data" / "v1.1" / "train-v1.1.json"
        if recipe == "squad"
        else data / "dolly" / "databricks-dolly-15k.jsonl"
    )
    assert f"    {expected}\n" in result.stdout
    assert "nothing was run or submitted" in result.stdout
    assert not data.exists()
    [script] = (tmp_path / "results" / f"sft_{recipe}").glob("*_submission.sh")
    assert f"-m {PROGRAM} {recipe}" in script.read_text()


def stage_check(*overrides: str) -> list:
    paths = ["data_dir=/nonexistent/data", "base_results_dir=/results", "dry_run=true"]
    cfg = resolve(compose_config([f"stages=[{STAGE}]", *paths, *overrides]), [STAGE])
    ctx = StageContext(cfg, STAGE)
    STAGES[STAGE].validate(ctx)
    return STAGES[STAGE].jobs(ctx)


def test_the_jobs_read_the_inputs_and_write_the_outputs() -> None:
    [job] = stage_check(f"{STAGE}=sft/squad")
    folder = "/nonexistent/data/squad_data/v1.1"
    assert job.reads == (f"{folder}/train-v1.1.json", f"{folder}/dev-v1.1.json")
    assert job.writes == tuple(
        f"{folder}/{split}-v1.1_{kind}"
        for split in ("train", "dev")
        for kind in ("gpt.json", "src.txt", "tgt.txt")
    )
    assert ["--all-answers" in command.args for command in job.commands] == [False, True]
    [job] = stage_check(
        f"{STAGE}=sft/squad", f"{STAGE}.train_output=null", f"{STAGE}.dev_output=null"
    )
    assert "--output" not in job.commands[0].args
    assert job.writes[:2] == (f"{folder}/train-v1.1_src.txt", f"{folder}/train-v1.1_tgt.txt")
    [job] = stage_check(f"{STAGE}=sft/dolly")
    folder = "/nonexistent/data/dolly"
    assert job.writes == tuple(f"{folder}/dolly_{s}.jsonl" for s in ("train", "validation", "test"))
    assert job.commands[0].args[job.commands[0].args.index("--seed") + 1] == "1234"


@pytest.mark.parametrize(
    ("overrides", "key", "problem"),
    [
        (
            [f"{STAGE}=sft/dolly", f"{STAGE}.split_fractions.train=0.5"],
            f"{STAGE}.split_fractions",
            "sum to 0.6",
        ),
        (
            [f"{STAGE}=sft/dolly", f"+{STAGE}.split_fractions.dev=0"],
            f"{STAGE}.split_fractions.dev",
            "is not a split",
        ),
        (
            [f"{STAGE}=sft/dolly", f"{STAGE}.split_fractions.test=-0.1"],
            f"{STAGE}.split_fractions.test",
            "between 0 and 1",
        ),
        ([f"{STAGE}=sft/dolly", f"{STAGE}.output_name=a/b"], f"{STAGE}.output_name", "prefix"),
        ([f"{STAGE}=sft/dolly", f"{STAGE}.seed=-1"], f"{STAGE}.seed", "integer"),
        (
            [f"{STAGE}=sft/squad", f"{STAGE}.train_output=${{.train_file}}"],
            f"{STAGE}.train_output",
            "is train_file too",
        ),
        (
            [f"{STAGE}=sft/squad", f"{STAGE}.dev_output=${{.train_output}}"],
            f"{STAGE}.dev_output",
            "is train_output too",
        ),
        ([f"{STAGE}=sft/squad", f"{STAGE}.max_bad_fraction=2"], f"{STAGE}.max_bad_fraction", "1"),
        (
            [f"{STAGE}=sft/squad", f"{STAGE}.dev_tgt_output=null"],
            f"{STAGE}.dev_tgt_output",
            "partner",
        ),
        (
            [f"{STAGE}=sft/squad", f"{STAGE}.train_tgt_output=${{.train_src_output}}"],
            f"{STAGE}.train_tgt_output",
            "is train_src_output too",
        ),
        (
            [
                f"{STAGE}=sft/squad",
                *(f"{STAGE}.train_{k}=null" for k in ("output", "src_output", "tgt_output")),
            ],
            f"{STAGE}.train_output",
            "so are train_src_output",
        ),
        ([f"{STAGE}=sft/xquad", f"{STAGE}.languages=[]"], f"{STAGE}.languages", "language codes"),
    ],
)
def test_bad_settings_name_their_key(overrides: list[str], key: str, problem: str) -> None:
    with pytest.raises(ConfigError) as error:
        stage_check(*overrides)
    assert error.value.key == key
    assert problem in error.value.problem


# ---- SQuAD for prompt learning -----------------------------------------------------------


def test_prompt_squad_downloads_and_writes_what_the_prompt_recipes_read(
    site: Site, tmp_path: Path
) -> None:
    """data_preparation=prompt/squad (5.10.1, 5.11.1's data): SQuAD fetched over HTTP (the
    train file's transfer cut midway, then resumed) and written as NeMo's prompt-learning
    records where prompt_learning, adapter_learning and ia3_learning gpt3/squad read them."""
    train, dev = json.dumps(SQUAD_TRAIN).encode(), json.dumps(SQUAD_DEV).encode()
    site.behaviour.files.update({"train-v1.1.json": train, "dev-v1.1.json": dev})
    site.behaviour.cut_after["train-v1.1.json"] = len(train) // 2
    result = run_main(
        f"stages=[{STAGE}]",
        f"{STAGE}=prompt/squad",
        f"data_dir={tmp_path / 'data'}",
        f"base_results_dir={tmp_path / 'results'}",
        f"{STAGE}.train_url={site.url}/train-v1.1.json",
        f"{STAGE}.dev_url={site.url}/dev-v1.1.json",
        f"{STAGE}.validation_fraction=0.25",
    )
    assert result.returncode == 0, output_of(result)
    assert len(site.behaviour.gets("train-v1.1.json")) == 2  # cut, then resumed
    folder = tmp_path / "data" / "prompt_data" / "v1.1"
    records = {
        name: read_jsonl(folder / f"squad_{name}.jsonl") for name in ("train", "val", "test")
    }
    assert [len(records[name]) for name in ("train", "val", "test")] == [3, 1, 2]
    questions = {r["question"] for r in records["train"] + records["val"]}
    assert "What is unanswerable here?" not in questions and len(questions) == 4
    nile = records["test"][0]
    assert nile["answer"] == "north" and nile["original_answers"] == [
        "north",
        "north",
        "flows north",
    ]
    assert "original_answers" not in records["train"][0]
    # Every field the recipes' prompt template names is in every record, and their data
    # paths are these files.
    for group in ("prompt_learning", "adapter_learning", "ia3_learning"):
        cfg = compose_config([f"{group}=gpt3/squad", f"data_dir={tmp_path / 'data'}"])
        section = resolve(cfg, [group])[group]
        paths = [section.model.data[split][0] for split in ("train_ds", "validation_ds", "test_ds")]
        assert paths == [str(folder / f"squad_{n}.jsonl") for n in ("train", "val", "test")]
        for template in section.model.get("task_templates") or []:
            fields = set(re.findall(r"\{(\w+)\}", template.prompt_template))
            assert fields and all(fields <= set(r) for rs in records.values() for r in rs)


def test_prompt_squad_refuses_a_share_that_empties_a_split(tmp_path: Path) -> None:
    result = run_main(
        f"stages=[{STAGE}]",
        f"{STAGE}=prompt/squad",
        f"base_results_dir={tmp_path / 'results'}",
        f"{STAGE}.validation_fraction=1.0",
        "dry_run=true",
    )
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: {STAGE}.validation_fraction: 1.0 leaves no"), (
        result.stderr
    )


def test_dolly_is_downloaded_first_when_a_url_is_given(site: Site, tmp_path: Path) -> None:
    """sft/dolly's download_url (the fine-tuning recipes' Dolly data, out of the box): fetched
    over HTTP into input_file, then converted as a local copy is."""
    local = write_dolly(tmp_path / "local", 20)
    site.behaviour.files["databricks-dolly-15k.jsonl"] = local.read_bytes()
    result = prepare(
        tmp_path, "dolly", f"{STAGE}.download_url={site.url}/databricks-dolly-15k.jsonl"
    )
    assert result.returncode == 0, output_of(result)
    folder = tmp_path / "data" / "dolly"
    assert (folder / "databricks-dolly-15k.jsonl").read_bytes() == local.read_bytes()
    counts = [len(read_jsonl(folder / f"dolly_{n}.jsonl")) for n in ("train", "validation", "test")]
    assert counts == [18, 1, 1]
