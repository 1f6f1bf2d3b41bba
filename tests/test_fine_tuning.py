"""Fine-tuning and PEFT on the tiny model, end to end through main.py, on CPU.

The task (tests/sft_task.py) is a fixed arbitrary word mapping the base cannot know: every
method must lower the validation loss from its step-0 baseline, LoRA and SFT must reach a
stated exact match, TP=2 LoRA must train exactly like TP=1, the PEFT file must be small, the
base weights must stay bit-identical, and merged LoRA must generate what base + LoRA does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

# The families register the tensor shapes the portable file checks compare weights with.
import launcher_scripts.families  # noqa: F401
from launcher_scripts.formats import portable
from launcher_scripts.jobs.fine_tuning import peft_file
from launcher_scripts.jobs.inference.text_tokenizer import load_text_tokenizer
from tests.support import REPO
from tests.support.commands import one_error_line, run_main
from tests.support.sft_task import write_task
from tests.support.training import in_process_check

ALL_TARGETS = "[attention_qkv,attention_dense,mlp_fc1,mlp_fc2]"


@pytest.fixture(scope="module")
def task(tiny_portable: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("sft_task")
    with tempfile.TemporaryDirectory() as scratch:
        base = portable.read(tiny_portable, Path(scratch))
        tokenizer = load_text_tokenizer(base.config.tokenizer)
        return write_task(folder, tokenizer, base.tensors["embedding.word_embeddings.weight"])


def common(stage: str, results: Path, base: Path, task: dict[str, Path]) -> list[str]:
    """CPU, one process, small batches and sequences, validation and test on the task."""
    data = f"{stage}.model.data"
    return [
        f"stages=[{stage}]",
        f"base_results_dir={results}",
        f"{stage}.model.restore_from_path={base}",
        f"{data}.train_ds.file_names=[{task['train']}]",
        f"{data}.validation_ds.file_names=[{task['val']}]",
        f"{data}.test_ds.file_names=[{task['test']}]",
        f"{data}.train_ds.max_seq_length=32",
        f"{stage}.trainer.accelerator=cpu",
        f"{stage}.trainer.precision=32",
        f"{stage}.trainer.devices=1",
        f"{stage}.trainer.log_every_n_steps=5",
        f"{stage}.model.global_batch_size=4",
        f"{stage}.model.micro_batch_size=2",
        f"{stage}.model.hidden_dropout=0.0",
        f"{stage}.model.attention_dropout=0.0",
        f"{stage}.model.optim.sched.warmup_steps=2",
        f"{data}.validation_ds.tokens_to_generate=1",  # the answers are single tokens
        f"{data}.test_ds.tokens_to_generate=1",
    ]


def run_stage(*overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    result = run_main(*overrides, timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def records(log_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def val_losses(log_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["val_loss"]) for r in records(log_dir) if "val_loss" in r]


def train_losses(log_dir: Path) -> list[float]:
    return [r["reduced_train_loss"] for r in records(log_dir) if "reduced_train_loss" in r]


def predictions(log_dir: Path) -> list[dict[str, Any]]:
    lines = (log_dir / "test_predictions.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def exact_match(log_dir: Path) -> float:
    rows = predictions(log_dir)
    return sum(row["exact_match"] for row in rows) / len(rows)


def peft_run(results: Path, base: Path, task: dict[str, Path], scheme: str, *extra: str) -> Path:
    run_stage(
        *common("peft", results, base, task),
        f"peft.model.peft.peft_scheme={scheme}",
        f"peft.run.task_name=task_{scheme}",
        *extra,
    )
    return results / "gpt3_126m" / f"peft_task_{scheme}" / "results"


@pytest.fixture(scope="module")
def lora(
    tiny_portable: Path, task: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """LoRA on every linear, rank 16: the run most tests read."""
    return peft_run(
        tmp_path_factory.mktemp("lora"),
        tiny_portable,
        task,
        "lora",
        f"peft.model.peft.lora_tuning.target_modules={ALL_TARGETS}",
        "peft.model.peft.lora_tuning.adapter_dim=16",
        "peft.model.optim.lr=3e-3",
        "peft.trainer.max_steps=120",
        "peft.trainer.val_check_interval=40",
        "peft.model.data.validation_ds.metric.name=exact_string_match",
    )


def test_lora_learns_the_mapping(lora: Path) -> None:
    losses = val_losses(lora)
    assert losses[0][0] == 0 and losses[0][1] > 5.0, losses  # the base cannot do the task
    assert losses[-1][0] == 120 and losses[-1][1] < 1.0, losses
    # Greedy answers; 8 of 8 were right when this was written. The answers were chosen
    # among tokens a frozen-embedding method can reach (see tests/sft_task.py).
    assert exact_match(lora) >= 0.75, predictions(lora)
    scores = [
        r["validation_exact_string_match"]
        for r in records(lora)
        if "validation_exact_string_match" in r
    ]
    assert scores[0] <= 0.25 and scores[-1] >= 0.75, scores  # step 0: the base


def test_peft_file_holds_only_the_adapters(lora: Path, tiny_portable: Path) -> None:
    path = lora / "checkpoints" / "megatron_gpt_peft_lora.nemo"
    loaded = peft_file.read(path)
    assert loaded.settings.scheme == "lora" and loaded.settings.rank == 16
    assert all(".peft." in key for key in loaded.tensors), sorted(loaded.tensors)
    layers = portable.read_config(tiny_portable).num_layers
    assert len(loaded.tensors) == layers * 4 * 2  # A and B for four linears per layer
    # What its readers compare a base with (families/file_family.py).
    assert loaded.config.base_model == str(tiny_portable)
    assert (loaded.config.model_family, loaded.config.base_architecture) == (
        "gpt",
        "GPT2LMHeadModel",
    )
    assert path.stat().st_size < 0.1 * tiny_portable.stat().st_size


@pytest.fixture(scope="module")
def lora_checks(lora: Path) -> dict[str, Any]:
    """tests/scripts/packed_losses.py on 8 samples and tests/scripts/peft_frozen.py for 5 steps
    on the LoRA run's tuner, in one process (tests/scripts/lora_checks.py): their reports."""
    return in_process_check("lora_checks", lora, "5", "8")


def test_base_weights_stay_bit_identical(lora_checks: dict[str, Any]) -> None:
    """A few more steps in-process, comparing every base tensor before and after."""
    report = lora_checks["frozen"]
    assert report["base_tensors"] > 10 and report["base_changed"] == [], report
    assert report["peft_changed"] == report["peft_tensors"] > 0, report


def test_merged_lora_generates_what_base_plus_lora_generates(
    lora: Path, tiny_portable: Path, tmp_path: Path
) -> None:
    merged = tmp_path / "merged.nemo"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher_scripts",
            "merge-lora",
            str(tiny_portable),
            str(lora / "checkpoints" / "megatron_gpt_peft_lora.nemo"),
            str(merged),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = predictions(lora)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([row["input"] for row in rows]))
    generated = subprocess.run(
        [sys.executable, "-m", "tests.scripts.generate_text", str(merged), str(prompts), "1"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert generated.returncode == 0, generated.stderr[-3000:]
    texts = json.loads(generated.stdout.strip().splitlines()[-1])
    assert [t.strip() for t in texts] == [row["pred"] for row in rows]
    assert {k: v for k, v in portable.read_config(merged).items() if k != "tokenizer"} == {
        k: v for k, v in portable.read_config(tiny_portable).items() if k != "tokenizer"
    }


def test_evaluation_stage_scores_base_plus_peft_at_another_layout(
    lora: Path, tiny_portable: Path, task: dict[str, Path], tmp_path: Path
) -> None:
    """Tuned at TP=1, evaluated at TP=2: the PEFT file is layout-independent."""
    run_stage(
        "stages=[evaluation]",
        "evaluation=peft_gpt3/squad",
        f"base_results_dir={tmp_path}",
        f"evaluation.model.language_model_path={tiny_portable}",
        f"evaluation.model.peft_model_file={lora / 'checkpoints' / 'megatron_gpt_peft_lora.nemo'}",
        f"evaluation.data.test_ds=[{task['test']}]",
        "evaluation.model.tensor_model_parallel_size=2",
        "evaluation.model.eval_batch_size=4",
        "evaluation.run.accelerator=cpu",
        "evaluation.inference.tokens_to_generate=1",
    )
    results_dir = tmp_path / "gpt3_126m" / "peft_squad_eval"
    results = json.loads((results_dir / "results.json").read_text())
    assert results["samples"] == 8 and results["exact_match"] >= 75.0, results
    evaluated = [json.loads(line) for line in (results_dir / "predictions.jsonl").open()]
    assert [row["pred"] for row in evaluated] == [row["pred"] for row in predictions(lora)]


def test_merge_refuses_a_non_lora_file(lora: Path, tiny_portable: Path, tmp_path: Path) -> None:
    ia3 = tmp_path / "ia3.nemo"
    loaded = peft_file.read(lora / "checkpoints" / "megatron_gpt_peft_lora.nemo")
    peft_file.write(ia3, type(loaded.settings)(scheme="ia3"), {}, {})
    out = tmp_path / "out.nemo"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher_scripts",
            "merge-lora",
            str(tiny_portable),
            str(ia3),
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "ia3" in result.stderr and not out.exists()


LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}


def test_tensor_and_pipeline_parallel_lora_train_like_one_process(
    tiny_portable: Path, task: dict[str, Path], tmp_path: Path
) -> None:
    runs = {}
    for name, (tensor, pipeline) in LAYOUTS.items():
        runs[name] = peft_run(
            tmp_path / name,
            tiny_portable,
            task,
            "lora",
            f"peft.model.peft.lora_tuning.target_modules={ALL_TARGETS}",
            "peft.model.optim.lr=3e-3",
            "peft.trainer.max_steps=15",
            "peft.trainer.val_check_interval=15",
            f"peft.trainer.devices={tensor * pipeline}",
            f"peft.model.tensor_model_parallel_size={tensor}",
            f"peft.model.pipeline_model_parallel_size={pipeline}",
        )
    reference = train_losses(runs["tp1"])
    reference_val = val_losses(runs["tp1"])
    weights = peft_file.read(runs["tp1"] / "checkpoints" / "megatron_gpt_peft_lora.nemo").tensors
    assert len(reference) == 3 and [s for s, _ in reference_val] == [0, 15]
    for name in ("tp2", "pp2"):
        assert train_losses(runs[name]) == pytest.approx(reference, rel=1e-5), name
        losses = val_losses(runs[name])
        assert [s for s, _ in losses] == [0, 15]
        assert [v for _, v in losses] == pytest.approx([v for _, v in reference_val], rel=1e-5)
        other = peft_file.read(runs[name] / "checkpoints" / "megatron_gpt_peft_lora.nemo").tensors
        assert sorted(other) == sorted(weights)
        for key, value in weights.items():
            assert value.shape == other[key].shape
            assert (value - other[key]).abs().max() < 1e-4, (name, key)


def test_packed_samples_give_the_losses_they_give_alone(lora_checks: dict[str, Any]) -> None:
    report = lora_checks["packed"]
    assert report["packed"] >= 3 and report["max_difference"] < 1e-4, report


def test_packed_training_lowers_validation_loss(
    tiny_portable: Path, task: dict[str, Path], tmp_path: Path
) -> None:
    log_dir = peft_run(
        tmp_path,
        tiny_portable,
        task,
        "lora",
        f"peft.model.peft.lora_tuning.target_modules={ALL_TARGETS}",
        "peft.model.optim.lr=3e-3",
        "peft.model.data.train_ds.packed_sequence=True",
        "peft.trainer.max_steps=20",
        "peft.trainer.val_check_interval=20",
    )
    (_, before), (_, after) = val_losses(log_dir)[0], val_losses(log_dir)[-1]
    assert after < 0.5 * before, (before, after)


@pytest.mark.parametrize(
    ("scheme", "extra"),
    [
        ("adapter", ["peft.model.peft.adapter_tuning.adapter_dim=16", "peft.model.optim.lr=3e-3"]),
        ("ia3", ["peft.model.optim.lr=3e-2"]),
        ("ptuning", ["peft.model.peft.p_tuning.bottleneck_dim=64", "peft.model.optim.lr=3e-3"]),
        ("prompt_tuning", ["peft.model.optim.lr=3e-2"]),
    ],
)
def test_each_method_lowers_validation_loss(
    scheme: str, extra: list[str], tiny_portable: Path, task: dict[str, Path], tmp_path: Path
) -> None:
    log_dir = peft_run(
        tmp_path,
        tiny_portable,
        task,
        scheme,
        *extra,
        "peft.trainer.max_steps=40",
        "peft.trainer.val_check_interval=40",
    )
    (start, before), (end, after) = val_losses(log_dir)[0], val_losses(log_dir)[-1]
    assert (start, end) == (0, 40)
    assert after < 0.7 * before, (scheme, before, after)
    assert (log_dir / "checkpoints" / f"megatron_gpt_peft_{scheme}.nemo").stat().st_size < 2**20


def test_full_fine_tuning_reaches_exact_match_and_writes_a_model(
    tiny_portable: Path, task: dict[str, Path], tmp_path: Path
) -> None:
    run_stage(
        *common("fine_tuning", tmp_path, tiny_portable, task),
        "fine_tuning.model.optim.lr=1e-3",
        "fine_tuning.trainer.max_steps=120",
        "fine_tuning.trainer.val_check_interval=120",
    )
    log_dir = tmp_path / "gpt3_126m" / "squad" / "results"
    assert val_losses(log_dir)[-1][1] < 0.1
    assert exact_match(log_dir) == 1.0, predictions(log_dir)
    tuned = portable.read_config(log_dir / "checkpoints" / "megatron_gpt3_squad.nemo")
    assert tuned.num_layers == portable.read_config(tiny_portable).num_layers


def test_adapter_learning_stage_reads_its_task_template(
    tiny_portable: Path, task: dict[str, Path], tmp_path: Path
) -> None:
    """The older recipe layout: file lists under model.data and one task template."""
    stage = "adapter_learning"
    run_stage(
        f"stages=[{stage}]",
        f"base_results_dir={tmp_path}",
        f"{stage}.model.language_model_path={tiny_portable}",
        f"{stage}.model.data.train_ds=[{task['train']}]",
        f"{stage}.model.data.validation_ds=[{task['val']}]",
        f"{stage}.model.data.test_ds=[{task['test']}]",
        f"{stage}.model.task_templates.0.prompt_template='{{input}} {{output}}'",
        f"{stage}.model.task_templates.0.answer_field=output",
        f"{stage}.model.task_templates.0.truncate_field=input",
        f"{stage}.model.encoder_seq_length=32",
        f"{stage}.model.global_batch_size=4",
        f"{stage}.model.micro_batch_size=2",
        f"{stage}.model.adapter_tuning.adapter_dropout=0.0",
        f"{stage}.model.optim.lr=3e-3",
        f"{stage}.model.optim.sched.warmup_steps=2",
        f"{stage}.trainer.accelerator=cpu",
        f"{stage}.trainer.precision=32",
        f"{stage}.trainer.devices=1",
        f"{stage}.trainer.max_steps=-1",
        f"{stage}.trainer.max_epochs=20",  # 8 records, batch 4: 40 steps
        f"{stage}.trainer.val_check_interval=40",
    )
    log_dir = tmp_path / "gpt3_126m" / "adapter_learning_squad" / "results"
    losses = val_losses(log_dir)
    assert [s for s, _ in losses] == [0, 40] and losses[1][1] < 0.6 * losses[0][1], losses
    assert (log_dir / "megatron_gpt_adapter.nemo").is_file()


def test_preflight_refuses_a_sequence_longer_than_the_base_model(
    tiny_portable: Path, task: dict[str, Path], tmp_path: Path
) -> None:
    overrides = common("peft", tmp_path, tiny_portable, task)
    result = run_main(*overrides, "peft.model.data.train_ds.max_seq_length=4096")
    one_error_line(result, "peft.model.data.train_ds.max_seq_length", "4096", "positions")
    assert not (tmp_path / "gpt3_126m").exists()


def test_preflight_refuses_a_sequence_that_does_not_split_over_tp(
    tiny_portable: Path, task: dict[str, Path], tmp_path: Path
) -> None:
    overrides = common("peft", tmp_path, tiny_portable, task)
    result = run_main(
        *overrides,
        "peft.model.data.train_ds.max_seq_length=31",
        "peft.trainer.devices=2",
        "peft.model.tensor_model_parallel_size=2",
        "peft.model.sequence_parallel=True",
    )
    one_error_line(result, "peft.model.data.train_ds.max_seq_length", "31", "sequence_parallel")


def test_preflight_names_a_missing_training_file(
    tiny_portable: Path, task: dict[str, Path], tmp_path: Path
) -> None:
    overrides = common("peft", tmp_path, tiny_portable, task)
    result = run_main(*overrides, f"peft.model.data.train_ds.file_names=[{tmp_path / 'no.jsonl'}]")
    one_error_line(result, "peft.model.data.train_ds.file_names[0]", "does not exist")


def test_the_answer_is_what_follows_the_split_string() -> None:
    """evaluation.data.split_string (NeMo's): the prediction is the generated text after its
    last split_string, as NeMo's split of prompt and generation gives for a prompt ending so."""
    from launcher_scripts.jobs.fine_tuning.evaluate_tuned import answer_part

    assert answer_part(" Paris.", "Answer:") == "Paris."
    assert answer_part(" Answer: Paris Answer: Lyon", "Answer:") == "Lyon"
    assert answer_part(" Paris", None) == "Paris"


def test_a_classification_metric_scores_the_answers(
    tiny_portable: Path, task: dict[str, Path], tmp_path: Path
) -> None:
    """validation_ds.metric.name=f1 with average=macro (NeMo's GLUE-style keys): each validation
    and the test pass score the greedy answers as class labels; the last validation and the
    test pass read the same model, and here the same records, so they agree."""
    from launcher_scripts.recipes.answer_metrics import AnswerMetric, score

    log_dir = peft_run(
        tmp_path,
        tiny_portable,
        task,
        "lora",
        "peft.trainer.max_steps=4",
        "peft.trainer.val_check_interval=4",
        "peft.model.data.validation_ds.metric.name=f1",
        "peft.model.data.validation_ds.metric.average=macro",
        f"peft.model.data.test_ds.file_names=[{task['val']}]",
    )
    scores = [(r["step"], r["validation_f1"]) for r in records(log_dir) if "validation_f1" in r]
    assert [step for step, _ in scores] == [0, 4], scores  # the untuned baseline, then step 4
    rows = predictions(log_dir)
    expected = score(AnswerMetric("f1", "macro"), [(r["pred"], r["label"]) for r in rows])
    assert scores[-1][1] == pytest.approx(expected)
