"""Evaluation with lm-evaluation-harness on a real trained model, on the CPU: our adapter's
log-likelihoods equal a direct computation from the model's logits, every TP/PP layout gives
the same numbers, the stage's job writes its results, and bad recipes fail in preflight."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from launcher_scripts.errors import ConfigError
from launcher_scripts.jobs.evaluation import report
from launcher_scripts.recipes import evaluation as recipe
from tests.support import REPO
from tests.support.commands import ONE_THREAD, assert_one_line_error, run_main

EVALUATE = "launcher_scripts.jobs.evaluation.evaluate"
BATCH = 3  # rows of different lengths share a batch, so padding is exercised


def check(model: Path, output: Path, tensor: int, pipeline: int) -> dict[str, Any]:
    """tests/scripts/eval_check.py on TP x PP processes; its JSON."""
    processes = tensor * pipeline
    launcher = [sys.executable]
    if processes > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    result = subprocess.run(
        [*launcher, "-m", "tests.scripts.eval_check", str(model), str(output)]
        + [str(tensor), str(pipeline), str(BATCH)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ONE_THREAD,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(output.read_text())


def scores(samples: dict[str, list[dict[str, Any]]]) -> dict[str, list[Any]]:
    """Per task, each request's answer from lm-eval's sample log: (log-prob, is_greedy) for
    loglikelihood requests, the log-prob of rolling ones, the text of generated ones."""
    flat: dict[str, list[Any]] = {}
    for task, rows in samples.items():
        flat[task] = [answer[0] for row in rows for answer in row["adapter"]]
    return flat


@pytest.fixture(scope="module")
def single(tiny_portable: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return check(tiny_portable, tmp_path_factory.mktemp("tp1") / "out.json", 1, 1)


def test_adapter_log_likelihoods_equal_a_direct_computation(single: dict[str, Any]) -> None:
    samples = single["samples"]
    assert sorted(samples) == sorted(recipe.OFFLINE_TASKS)
    pairs = 0
    for task in ("tiny_lambada", "tiny_choice"):
        for row in samples[task]:
            for (adapter,), direct in zip(row["adapter"], row["direct"], strict=True):
                assert adapter[0] == pytest.approx(direct[0], abs=1e-5), (task, row)
                assert adapter[1] == direct[1], (task, row)
                pairs += 1
    assert pairs == 30 + 30 * 4
    # Some continuations are the model's greedy choice and some are not: both flags occur.
    flags = {adapter[1] for row in samples["tiny_choice"] for (adapter,) in row["adapter"]}
    assert flags == {True, False}


def test_rolling_log_likelihood_is_the_whole_document(single: dict[str, Any]) -> None:
    rows = single["samples"]["tiny_wikitext"]
    assert len(rows) == 30
    for row in rows:
        assert row["adapter"][0][0] == pytest.approx(row["direct"], abs=1e-5)
    # Documents that fit the model's 128 positions and longer ones (several windows) alike.
    lengths = [row["tokens"] for row in rows]
    assert min(lengths) <= 128 < max(lengths), lengths
    assert single["metrics"]["tiny_wikitext"]["word_perplexity,none"] > 1


@pytest.mark.parametrize(("tensor", "pipeline"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_every_layout_gives_the_same_numbers(
    tiny_portable: Path, single: dict[str, Any], tmp_path: Path, tensor: int, pipeline: int
) -> None:
    parallel = check(tiny_portable, tmp_path / "out.json", tensor, pipeline)
    ours, theirs = scores(single["samples"]), scores(parallel["samples"])
    assert ours["tiny_generate"] == theirs["tiny_generate"]
    for task in ("tiny_lambada", "tiny_choice", "tiny_wikitext"):
        for one, other in zip(ours[task], theirs[task], strict=True):
            if isinstance(one, list):
                assert one[0] == pytest.approx(other[0], abs=1e-4), task
                assert one[1] == other[1], task
            else:
                assert one == pytest.approx(other, abs=1e-4), task
    # The parallel run is also right in itself, not just equal.
    for row in parallel["samples"]["tiny_wikitext"]:
        assert row["adapter"][0][0] == pytest.approx(row["direct"], abs=1e-5)


def test_the_stage_job_writes_results_at_tp2(tiny_portable: Path, tmp_path: Path) -> None:
    results = tmp_path / "results"
    result = run_main(
        "stages=[evaluation]",
        f"base_results_dir={results}",
        f"data_dir={tmp_path}/data",
        f"evaluation.model.nemo_model={tiny_portable}",
        "evaluation.model.tensor_model_parallel_size=2",
        "evaluation.run.limit=10",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    folder = results / "gpt3_tiny" / "eval_all"
    script = (folder / "eval_all_gpt3_tiny_submission.sh").read_text()
    assert "--nproc-per-node=2" in script
    written = json.loads((folder / "results.json").read_text(), parse_constant=_no_constants)
    assert sorted(written["results"]) == sorted(recipe.OFFLINE_TASKS)
    assert written["results"]["tiny_choice"]["sample_len"] == 10
    assert 0 <= written["results"]["tiny_choice"]["acc,none"] <= 1
    table = (folder / "results.md").read_text().splitlines()
    assert table[0] == "| task | metric | value | stderr |"
    metrics = {tuple(cell.strip() for cell in line.split("|")[1:3]) for line in table[2:]}
    assert metrics == {
        ("tiny_lambada", "perplexity"),
        ("tiny_lambada", "acc"),
        ("tiny_choice", "acc"),
        ("tiny_choice", "acc_norm"),
        ("tiny_wikitext", "word_perplexity"),
        ("tiny_wikitext", "byte_perplexity"),
        ("tiny_wikitext", "bits_per_byte"),
        ("tiny_generate", "exact_match"),
    }
    for task in recipe.OFFLINE_TASKS:
        lines = (folder / f"samples_{task}.jsonl").read_text().splitlines()
        assert len(lines) == 10
        assert "resps" in json.loads(lines[0])
    # Only rank 0 wrote: no second copy and no temporary files.
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]


def _no_constants(name: str) -> None:
    raise AssertionError(f"results.json holds {name}, which is not JSON")


def test_an_unreachable_dataset_fails_in_one_line_naming_the_task(
    tiny_portable: Path, tmp_path: Path
) -> None:
    config = tmp_path / "eval.yaml"
    config.write_text(
        json.dumps(
            {
                "run": {"tasks": "tiny_choice,lambada", "results_dir": str(tmp_path / "out")},
                "model": {
                    "nemo_model": str(tiny_portable),
                    "tensor_model_parallel_size": 1,
                    "pipeline_model_parallel_size": 1,
                    "eval_batch_size": 2,
                    "precision": None,
                },
            }
        )
    )
    env = {**ONE_THREAD, "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher_scripts.jobs.evaluation.evaluate",
            "--config",
            str(config),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: task lambada (lambada_openai): its dataset is not available")
    assert "offline_tasks" in last and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


# -- preflight ---------------------------------------------------------------------------------


def preflight(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return run_main(
        f"base_results_dir={tmp_path}/results",
        f"data_dir={tmp_path}/data",
        "dry_run=true",
        *overrides,
    )


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_unknown_task_names_the_key_and_the_choices(tmp_path: Path) -> None:
    model = tmp_path / "model.nemo"
    model.write_bytes(b"not read before the task names are checked")
    line = one_line_error(
        preflight(
            tmp_path,
            "stages=[evaluation]",
            f"evaluation.model.nemo_model={model}",
            "evaluation.run.tasks=[lambada,squad]",
        )
    )
    assert line.startswith("error: evaluation.run.tasks: 'squad' is not a task")
    for choice in ("all_tasks", "offline_tasks", "lambada", "wikitext103", "tiny_generate"):
        assert choice in line
    assert not (tmp_path / "results").exists()


def test_missing_model_names_the_key(tmp_path: Path) -> None:
    # A real run (a dry run lists missing inputs instead): preflight stops it before any file.
    result = run_main(
        f"base_results_dir={tmp_path}/results", f"data_dir={tmp_path}/data", "stages=[evaluation]"
    )
    assert not (tmp_path / "results").exists()
    line = one_line_error(result)
    assert line.startswith("error: evaluation.model.nemo_model: ")
    assert "stages=[conversion,evaluation]" in line


def test_layout_must_divide_the_model(tiny_portable: Path, tmp_path: Path) -> None:
    line = one_line_error(
        preflight(
            tmp_path,
            "stages=[evaluation]",
            f"evaluation.model.nemo_model={tiny_portable}",
            "evaluation.model.tensor_model_parallel_size=3",
        )
    )
    assert line.startswith("error: evaluation.model.tensor_model_parallel_size: 3 does not divide")


def test_the_whole_pipeline_plans_with_evaluation_last(tmp_path: Path) -> None:
    """The model file does not exist yet: conversion writes it, so preflight passes, and the
    layout is checked against the training recipe."""
    stages = "stages=[data_preparation,training,conversion,evaluation]"
    result = preflight(tmp_path, stages, "evaluation.model.pipeline_model_parallel_size=2")
    assert result.returncode == 0, result.stderr
    script = tmp_path / "results" / "gpt3_tiny" / "eval_all" / "eval_all_gpt3_tiny_submission.sh"
    assert "launcher_scripts.jobs.evaluation.evaluate" in script.read_text()
    line = one_line_error(
        preflight(tmp_path, stages, "evaluation.model.pipeline_model_parallel_size=3")
    )
    assert line.startswith("error: evaluation.model.pipeline_model_parallel_size: 3 does not")


# -- small pieces --------------------------------------------------------------------------------


def test_task_names_expand_in_order_once() -> None:
    names = recipe.requested_names("lambada, offline_tasks,tiny_choice,,wikitext2")
    assert recipe.lm_eval_tasks(names, set()) == [
        "lambada_openai",
        *recipe.OFFLINE_TASKS,
        "wikitext",
    ]
    assert len(recipe.lm_eval_tasks(["all_tasks"], set())) == 8
    with pytest.raises(ConfigError, match="evaluation.run.tasks: 'mine' is not a task"):
        recipe.lm_eval_tasks(["mine"], set())


def test_include_path_tasks_are_known(tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text(
        "task: mine\ncustom_dataset: !function my_module.load\noutput_type: loglikelihood\n"
    )
    paths = recipe.include_paths(str(tmp_path))
    assert recipe.lm_eval_tasks(["mine"], recipe.user_task_names(paths)) == ["mine"]


def test_results_table_and_strict_json(tmp_path: Path) -> None:
    results = {
        "results": {
            "t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1, "ppl,none": float("nan")}
        },
        "samples": {"t": [{"resps": [[[-1.5, True]]]}]},
    }
    report.write(tmp_path, results)
    assert (tmp_path / "results.md").read_text().splitlines()[2:] == [
        "| t | acc | 0.5000 | 0.1000 |",
        "| t | ppl | nan |  |",
    ]
    written = json.loads((tmp_path / "results.json").read_text(), parse_constant=_no_constants)
    assert written["results"]["t"]["ppl,none"] is None and "samples" not in written
    assert json.loads((tmp_path / "samples_t.jsonl").read_text()) == {"resps": [[[-1.5, True]]]}


def test_a_training_checkpoint_is_evaluated_as_its_converted_file(
    tiny_portable: Path, tmp_path: Path
) -> None:
    """NeMo's evaluation.model.checkpoint_folder (5.13.1.3): the stage converts the newest
    checkpoint itself, at the evaluation's layout, and gets what the converted file gets."""
    trained = tiny_portable.parent.parent / "results"
    assert (trained / "checkpoints").is_dir() and (trained / "hparams.yaml").is_file()
    common = ("stages=[evaluation]", f"data_dir={tmp_path}/data", "evaluation.run.limit=5")
    common += ("evaluation.run.tasks=[tiny_lambada,tiny_choice]",)
    by_file = run_main(
        *common, f"base_results_dir={tmp_path}/file", f"evaluation.model.nemo_model={tiny_portable}"
    )
    assert by_file.returncode == 0, by_file.stderr[-3000:]
    result = run_main(
        *common,
        f"base_results_dir={tmp_path}/checkpoint",
        f"evaluation.model.checkpoint_folder={trained / 'checkpoints'}",
        "evaluation.model.tensor_model_parallel_size=2",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    folder = tmp_path / "checkpoint" / "gpt3_tiny" / "eval_all"
    assert (folder / recipe.CONVERTED_FILE).is_file()
    assert "convert_eval_all_gpt3_tiny" in result.stdout
    read = [
        json.loads((root / "gpt3_tiny" / "eval_all" / "results.json").read_text())["results"]
        for root in (tmp_path / "file", tmp_path / "checkpoint")
    ]
    for task in ("tiny_lambada", "tiny_choice"):
        assert read[1][task]["acc,none"] == pytest.approx(read[0][task]["acc,none"])
    assert read[1]["tiny_lambada"]["perplexity,none"] == pytest.approx(
        read[0]["tiny_lambada"]["perplexity,none"], rel=1e-4
    )


def test_a_checkpoints_keys_without_the_checkpoint_are_refused(tmp_path: Path) -> None:
    result = run_main(
        f"base_results_dir={tmp_path}/r",
        "stages=[evaluation]",
        "evaluation.model.hparams_file=/x/hparams.yaml",
        "dry_run=true",
    )
    assert_one_line_error(result, "evaluation.model.hparams_file", "checkpoint_folder")
    missing = run_main(
        f"base_results_dir={tmp_path}/r",
        "stages=[evaluation]",
        f"evaluation.model.checkpoint_folder={tmp_path}/none/checkpoints",
    )
    assert_one_line_error(missing, "evaluation.model.checkpoint_folder", "does not exist")
