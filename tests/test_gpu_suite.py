"""The GPU suite (bench/gpu/run.sh) rehearsed on CPU, so that a change that breaks it fails here
and not on the rarely lent GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.support import REPO

sys.path.insert(0, str(REPO))

from bench.gpu import steps, suite  # noqa: E402


def rehearse(out: Path, *only: str) -> dict:
    command = ["bash", "bench/gpu/run.sh", "--rehearse", "--out", str(out)]
    command += ["--only", *only] if only else []
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def check_shape(summary: dict, out: Path, names: list[str]) -> None:
    assert summary["rehearse"] is True
    assert {"date", "commit", "device", "seconds", "steps"} <= summary.keys()
    assert [step["name"] for step in summary["steps"]] == names
    for step in summary["steps"]:
        assert step["status"] in suite.STATUSES, step
        assert isinstance(step["figures"], dict) and isinstance(step["commands"], list), step
        assert step["commands"], step  # every step says what it ran
    # Only three files come back from the GPU machine: the logs travel in one archive.
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "summary.json", "summary.md"]
    with tarfile.open(out / "logs.tar.gz") as archive:
        members = set(archive.getnames())
    assert {f"logs/{name}.log" for name in names} <= members
    markdown = (out / "summary.md").read_text()
    assert all(f"| {name} | " in markdown for name in names)


def test_a_step_past_its_time_box_fails_and_the_next_runs(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    for folder in ("steps", "logs", "work"):
        (scratch / folder).mkdir(parents=True)
    late = suite.run_step("ceiling", scratch, rehearse=True, budget=0.01)
    assert late["status"] == "failed" and "timed out" in late["reason"], late
    on_time = suite.run_step("ceiling", scratch, rehearse=True, budget=120)
    assert on_time["status"] == "passed", on_time
    assert on_time["figures"]["matmul_tflops"] > 0


def test_step_budgets_are_cut_to_what_the_suite_has_left() -> None:
    step = steps.Step(steps.ceiling, budget_s=30, rehearsal_s=40)
    assert suite.step_budget(step, rehearse=False, left=None) == 30
    assert suite.step_budget(step, rehearse=True, left=None) == 40
    assert suite.step_budget(step, rehearse=False, left=100) == 30
    assert suite.step_budget(step, rehearse=False, left=20) == 20
    assert suite.step_budget(step, rehearse=False, left=suite.MIN_STEP_S - 1) is None


def test_steps_past_the_deadline_are_skipped_and_the_results_still_written(tmp_path: Path) -> None:
    command = [sys.executable, "bench/gpu/suite.py", "--rehearse", "--out", str(tmp_path)]
    command += ["--deadline", str(suite.MIN_STEP_S / 2), "--only", "ceiling", "probe"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["complete"] is True and summary["deadline_s"] == suite.MIN_STEP_S / 2
    for step in summary["steps"]:
        assert step["status"] == "skipped" and "no time left" in step["reason"], step
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "logs.tar.gz",
        "summary.json",
        "summary.md",
    ]


def test_an_unknown_step_is_one_line(tmp_path: Path) -> None:
    command = [sys.executable, "bench/gpu/suite.py", "--rehearse", "--out", str(tmp_path)]
    result = subprocess.run(
        [*command, "--only", "trainig"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert "--only: no step trainig (steps: ceiling, probe, training" in result.stderr
    assert not (tmp_path / "summary.json").exists()


def test_the_quick_steps_rehearse(tmp_path: Path) -> None:
    summary = rehearse(tmp_path, "ceiling", "probe")
    check_shape(summary, tmp_path, ["ceiling", "probe"])
    assert all(step["status"] == "passed" for step in summary["steps"]), summary


@pytest.mark.slow
def test_the_whole_rehearsal(tmp_path: Path) -> None:
    summary = rehearse(tmp_path)
    check_shape(summary, tmp_path, list(steps.STEPS))
    # Every step of the suite but vLLM's runs on CPU in the rehearsal, so each must pass; the
    # vLLM step writes the repository and then stops where vLLM is missing (it is here).
    by_name = {step["name"]: step for step in summary["steps"]}
    vllm = by_name.pop("vllm")
    assert vllm["status"] == "skipped" and "the repository is written" in vllm["reason"], vllm
    assert all(step["status"] == "passed" for step in by_name.values()), summary
    training = next(step for step in summary["steps"] if step["name"] == "training")["figures"]
    assert training["loss_falls"] is True
    assert training["gpu_recipe_dry_run"] == "passed"
    assert training["tokens_per_s"] > 0 and training["bare_step_s"] > 0
    converted = next(step for step in summary["steps"] if step["name"] == "conversion")["figures"]
    assert converted["hf_logits_finite"] is True and converted["nemo_mb"] > 0
    generated = next(step for step in summary["steps"] if step["name"] == "generation")["figures"]
    assert generated["generated_tokens"] > 0 and generated["tokens_per_s"] > 0
    assert generated["in_flight_clients"] == 8 and generated["in_flight_ratio"] > 0
    memory = next(step for step in summary["steps"] if step["name"] == "memory")["figures"]
    for layout in steps.LAYOUTS:  # each GPU layout planned and dry-run
        assert memory[f"{layout}_dry_run"] == "passed" and memory[f"{layout}_plan_gib"] > 0
    assert memory["seq2048_cpu_trained"] is True
    recompute = next(step for step in summary["steps"] if step["name"] == "recompute")["figures"]
    for setting in steps.RECOMPUTE_SETTINGS:
        assert recompute[f"{setting}_dry_run"] == "passed"
    planned = [recompute[f"{setting}_plan_gib"] for setting in ("none", "selective", "full")]
    assert planned == sorted(planned, reverse=True), planned
    encoders = next(step for step in summary["steps"] if step["name"] == "encoders")["figures"]
    for family in ("t5", "bert"):
        assert encoders[f"{family}_loss_last"] < encoders[f"{family}_loss_first"]
        assert encoders[f"{family}_gpu_dry_run"] == "passed"
    evaluation = next(step for step in summary["steps"] if step["name"] == "evaluation")["figures"]
    assert evaluation["requests"] > 100 and evaluation["requests_per_s"] > 0
    # fp32 on CPU: the adapter's log-probabilities are transformers' on the export.
    assert evaluation["vs_transformers_max_token_diff"] <= steps.EVAL_TOKEN_DIFF_FP32
    assert evaluation["vs_transformers_choice_agreement"] == 1
    assert evaluation["harness"].startswith("dry run passed"), evaluation
    tuned = next(step for step in summary["steps"] if step["name"] == "finetuning")["figures"]
    for name in ("sft", "lora"):
        assert tuned[f"{name}_step_s"] > 0 and "(step 0) ->" in tuned[f"{name}_val_loss"]
    assert 0 < tuned["lora_file_mb"] < 1
