"""BERT pretraining on megatron-core, for real on the CPU: the tiny recipe learns through
`python3 main.py`, TP2 / PP2 / sequence parallelism give the single process's losses, a stopped
run resumes exactly, and the recipe's BERT keys are checked before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher_scripts.formats.progress import EXIT_PREEMPTED
from tests.conftest import (
    assert_same_losses,
    losses,
    run_main,
    stop_with_signal,
    train,
    write_training_config,
)

SMALL = (
    "training=bert/tiny",
    "training.model.micro_batch_size=2",
    "training.model.global_batch_size=4",
    "training.model.optim.sched.warmup_steps=2",
    "training.trainer.log_every_n_steps=1",
    "training.trainer.val_check_interval=4",
    "training.trainer.limit_val_batches=1",
)


def write_config(prepared: Path, log_dir: Path, *overrides: str) -> Path:
    return write_training_config(prepared, log_dir, *SMALL, *overrides)


def test_bert_tiny_learns_through_main(prepared_wordpiece: Path, tmp_path: Path) -> None:
    result = run_main(
        "stages=[training]",
        "training=bert/tiny",
        f"data_dir={prepared_wordpiece}/data",
        f"base_results_dir={tmp_path}",
        "training.trainer.max_steps=60",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log_dir = tmp_path / "bert_tiny" / "results"
    curve = losses(log_dir)
    first, last = curve[min(curve)], curve[max(curve)]
    # From about ln(2048) + ln(2) (masked tokens and sentence order at chance) to well below.
    assert first > 7.5 and last < first - 0.8, curve
    assert (log_dir / "loss_curve.png").stat().st_size > 0
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["model_tflops_per_gpu"] > 0 for r in records if "model_tflops_per_gpu" in r)
    assert any((log_dir / "checkpoints").iterdir())


LAYOUT_STEPS = ("training.trainer.max_steps=6",)


@pytest.fixture(scope="module")
def single_process(prepared_wordpiece: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six steps on one process: the run every layout is compared with."""
    log_dir = tmp_path_factory.mktemp("bert_single") / "single"
    index = f"training.model.data.index_mapping_dir={log_dir.parent}/i"
    train(write_config(prepared_wordpiece, log_dir, *LAYOUT_STEPS, index))
    return log_dir


@pytest.mark.parametrize(
    "layout",
    [
        ("training.model.tensor_model_parallel_size=2",),
        ("training.model.pipeline_model_parallel_size=2",),
        ("training.model.tensor_model_parallel_size=2", "training.model.sequence_parallel=true"),
    ],
    ids=["tp2", "pp2", "tp2-sequence-parallel"],
)
def test_bert_layouts_match_a_single_process(
    prepared_wordpiece: Path, single_process: Path, tmp_path: Path, layout: tuple[str, ...]
) -> None:
    index = f"training.model.data.index_mapping_dir={single_process.parent}/i"
    parallel = write_config(
        prepared_wordpiece,
        tmp_path / "parallel",
        *LAYOUT_STEPS,
        index,
        "training.trainer.devices=2",
        *layout,
    )
    train(parallel, processes=2)
    assert_same_losses(single_process, tmp_path / "parallel", 1e-4)


def test_bert_stop_and_resume_match_an_uninterrupted_run(
    prepared_wordpiece: Path, tmp_path: Path
) -> None:
    steps = (
        "training.trainer.max_steps=30",
        "training.exp_manager.checkpoint_callback_params.every_n_train_steps=10",
        f"training.model.data.index_mapping_dir={tmp_path}/i",
    )
    train(write_config(prepared_wordpiece, tmp_path / "reference", *steps))
    config = write_config(prepared_wordpiece, tmp_path / "resumed", *steps)
    assert stop_with_signal(config, tmp_path / "resumed", 1) == EXIT_PREEMPTED
    assert max(losses(tmp_path / "resumed")) < 30
    assert "resumed from" in train(config).stdout
    assert_same_losses(tmp_path / "reference", tmp_path / "resumed", 0.0)


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ("training.model.data.dataloader_type=LDDL",
         ["training.model.data.dataloader_type", "LDDL is not supported"]),
        ("training.model.transformer_block_type=normformer",
         ["training.model.transformer_block_type", "pre_ln"]),
        ("training.model.bert_binary_head=maybe", ["training.model.bert_binary_head"]),
    ],
)  # fmt: skip
def test_bad_bert_keys_are_one_line(override: str, fragments: list[str], tmp_path: Path) -> None:
    result = run_main(
        "stages=[training]", "training=bert/tiny", "dry_run=true", f"data_dir={tmp_path}",
        f"base_results_dir={tmp_path / 'results'}", override,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = result.stderr.strip().splitlines()
    assert all(fragment in line for fragment in fragments), line
    assert not (tmp_path / "results").exists()


def test_the_published_layout_trains(prepared_wordpiece: Path, tmp_path: Path) -> None:
    """The published recipes' BERT: pre-LN (megatron-core's), GeGLU, no sentence-order head."""
    log_dir = tmp_path / "run"
    layout = (
        "training.model.transformer_block_type=pre_ln",
        "training.model.activation=geglu",
        "training.model.bert_binary_head=false",
        "training.model.layernorm_epsilon=1e-5",
        "training.trainer.max_steps=8",
    )
    train(write_config(prepared_wordpiece, log_dir, *layout))
    curve = losses(log_dir)
    assert sorted(curve) == list(range(1, 9)) and curve[8] < curve[1], curve
