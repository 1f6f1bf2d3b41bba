"""T5 and mT5 pretraining on megatron-core, for real on the CPU: the tiny recipes learn through
`python3 main.py` (T5 with a WordPiece vocabulary, mT5 with SentencePiece), TP2 and sequence
parallelism give the single process's losses (learned and relative position embeddings), a
stopped run resumes exactly, and what this version cannot train is refused before it runs."""

from __future__ import annotations

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

# The vocabulary (2000 WordPieces, [BOS], [EOS], 100 sentinels) padded to 4096 at TP 1 and TP 2
# alike, so that layouts compute the same softmax.
SMALL = (
    "training=t5/tiny",
    "training.model.make_vocab_size_divisible_by=2048",
    "training.model.micro_batch_size=2",
    "training.model.global_batch_size=4",
    "training.trainer.log_every_n_steps=1",
    "training.trainer.val_check_interval=4",
    "training.trainer.limit_val_batches=1",
)


def write_config(prepared: Path, log_dir: Path, *overrides: str) -> Path:
    return write_training_config(prepared, log_dir, *SMALL, *overrides)


def assert_learns(log_dir: Path, drop: float) -> None:
    curve = losses(log_dir)
    first, last = curve[min(curve)], curve[max(curve)]
    assert last < first - drop, curve
    assert (log_dir / "loss_curve.png").stat().st_size > 0
    assert any((log_dir / "checkpoints").iterdir())


def test_t5_tiny_learns_through_main(prepared_wordpiece: Path, tmp_path: Path) -> None:
    result = run_main(
        "stages=[training]",
        "training=t5/tiny",
        f"data_dir={prepared_wordpiece}/data",
        f"base_results_dir={tmp_path}",
        "training.trainer.max_steps=40",
        "training.trainer.log_every_n_steps=5",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_learns(tmp_path / "t5_tiny" / "results", 1.0)


def test_mt5_tiny_learns_from_sentencepiece_data(tmp_path: Path) -> None:
    """mT5's kind of tokenizer: the default SentencePiece model, sentinels past its pieces."""
    result = run_main(
        "stages=[data_preparation,training]",
        "training=mt5/tiny",
        f"data_dir={tmp_path}/data",
        f"base_results_dir={tmp_path}",
        "data_preparation.split_sentences=true",
        "data_preparation.append_eod=false",
        "training.trainer.max_steps=40",
        "training.trainer.log_every_n_steps=5",
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_learns(tmp_path / "mt5_tiny" / "results", 1.0)


LAYOUT_STEPS = ("training.trainer.max_steps=6",)


@pytest.fixture(scope="module")
def single_process(prepared_wordpiece: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six steps on one process: the run the learned-position layouts are compared with."""
    log_dir = tmp_path_factory.mktemp("t5_single") / "single"
    index = f"training.model.data.index_mapping_dir={log_dir.parent}/i"
    train(write_config(prepared_wordpiece, log_dir, *LAYOUT_STEPS, index))
    return log_dir


@pytest.mark.parametrize(
    "layout",
    [
        ("training.model.tensor_model_parallel_size=2",),
        ("training.model.tensor_model_parallel_size=2", "training.model.sequence_parallel=true"),
    ],
    ids=["tp2", "tp2-sequence-parallel"],
)
def test_t5_layouts_match_a_single_process(
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


def test_t5_relative_positions_match_at_tp2(prepared_wordpiece: Path, tmp_path: Path) -> None:
    """T5's bucketed relative bias, split over the tensor-parallel ranks by head."""
    steps = (
        *LAYOUT_STEPS,
        f"training.model.data.index_mapping_dir={tmp_path}/i",
        "training.model.position_embedding_type=relative",
    )
    train(write_config(prepared_wordpiece, tmp_path / "single", *steps))
    parallel = write_config(
        prepared_wordpiece,
        tmp_path / "parallel",
        *steps,
        "training.trainer.devices=2",
        "training.model.tensor_model_parallel_size=2",
    )
    train(parallel, processes=2)
    assert_same_losses(tmp_path / "single", tmp_path / "parallel", 1e-4)


def test_t5_stop_and_resume_match_an_uninterrupted_run(
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


def test_t5_pipeline_parallelism_is_refused_before_a_real_run(
    prepared_wordpiece: Path, tmp_path: Path
) -> None:
    """A dry run checks and renders a PP 2 recipe (t5/23b is one); a real run stops at once."""
    common = (
        "stages=[training]", "training=t5/tiny", f"data_dir={prepared_wordpiece}/data",
        "training.trainer.devices=2",
        "training.model.pipeline_model_parallel_size=2",
        "training.model.pipeline_model_parallel_split_rank=1",
    )  # fmt: skip
    assert run_main(*common, "dry_run=true", f"base_results_dir={tmp_path / 'dry'}").returncode == 0
    result = run_main(*common, f"base_results_dir={tmp_path / 'results'}")
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "training.model.pipeline_model_parallel_size" in line
    assert "T5 on 2 pipeline stages" in line
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ("training.model.encoder.transformer_block_type=post_ln",
         ["training.model.encoder.transformer_block_type", "pre_ln"]),
        ("training.model.tokenizer.num_sentinel_tokens=many",
         ["training.model.tokenizer.num_sentinel_tokens"]),
        ("training.model.position_embedding_type=rope",
         ["training.model.position_embedding_type", "relative"]),
    ],
)  # fmt: skip
def test_bad_t5_keys_are_one_line(override: str, fragments: list[str], tmp_path: Path) -> None:
    result = run_main(
        "stages=[training]", "training=t5/tiny", "dry_run=true", f"data_dir={tmp_path}",
        f"base_results_dir={tmp_path / 'results'}", override,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = result.stderr.strip().splitlines()
    assert all(fragment in line for fragment in fragments), line
