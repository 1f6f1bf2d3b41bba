"""T5 and mT5 pretraining and conversion on megatron-core, for real on the CPU: the tiny recipes
learn and convert through `python3 main.py` (T5 with a WordPiece vocabulary, mT5 with
SentencePiece), transformers' T5 and MT5 classes compute the converted model's logits, the
portable file rebuilds the model exactly at another TP/PP, TP2, sequence parallelism and two or
three pipeline stages (the encoder on all but the last) give the single process's losses
(learned and relative position embeddings), a stopped run resumes exactly, and what this
version cannot train or export is refused before it runs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from launcher_scripts.formats.progress import EXIT_PREEMPTED
from tests.support import REPO
from tests.support.commands import ONE_THREAD, run_main
from tests.support.conversion import assert_same_outputs, convert, reshard_checks
from tests.support.training import (
    assert_same_losses,
    losses,
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


def t5_inputs(vocabulary: int) -> dict[str, Any]:
    """Encoder and decoder tokens, the second row padded (id 0) in both."""
    generator = torch.Generator().manual_seed(0)
    encoder = torch.randint(5, vocabulary, (3, 40), generator=generator)
    decoder = torch.randint(5, vocabulary, (3, 17), generator=generator)
    encoder[1, 25:] = 0
    decoder[1, 11:] = 0
    return {"text_enc": encoder, "text_dec": decoder}


def logits_of(script: str, triples: list[tuple[Path, Path, Path]]) -> str:
    """tests/scripts/<script>.py (portable_logits or hf_logits) on every (model, inputs, output)
    in one fresh process; its output."""
    result = subprocess.run(
        [sys.executable, "-m", f"tests.scripts.{script}"]
        + [str(path) for triple in triples for path in triple],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ONE_THREAD,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


CONVERT_TO_HF = ("conversion.model.vocab_file=null", "conversion.run.hf_dir_name=hf")


@pytest.fixture(scope="module")
def mt5_converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mT5 tiny prepared (SentencePiece), trained for 40 steps and converted through main.py;
    returns the results root."""
    root = tmp_path_factory.mktemp("mt5")
    result = run_main(
        "stages=[data_preparation,training,conversion]",
        "training=mt5/tiny",
        "conversion=mt5/convert_mt5",
        *CONVERT_TO_HF,
        f"data_dir={root}/data",
        f"base_results_dir={root}",
        "data_preparation.split_sentences=true",
        "data_preparation.append_eod=false",
        "training.trainer.max_steps=40",
        "training.trainer.log_every_n_steps=5",
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root


# (converted folder, portable file, the transformers class it must load as) of each family.
CONVERTED = {
    "t5": ("t5_tiny/convert_nemo", "megatron_t5.nemo", "T5ForConditionalGeneration"),
    "mt5": ("mt5_tiny/convert_nemo", "megatron_mt5.nemo", "MT5ForConditionalGeneration"),
}


@pytest.fixture(scope="module")
def logits(
    t5_converted: Path, mt5_converted: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any], str]]:
    """Each converted model's (inputs, our logits, transformers' logits, the class transformers
    chose): our model from the portable file and transformers from the export, each computed
    in a fresh process (one of ours for both models, one of transformers' for both)."""
    folder = tmp_path_factory.mktemp("t5_logits")
    roots = {"t5": t5_converted, "mt5": mt5_converted}
    inputs, ours, theirs = {}, [], []
    for family, (converted, nemo, _) in CONVERTED.items():
        hf_dir = roots[family] / converted / "hf"
        vocabulary = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
        inputs[family] = t5_inputs(vocabulary)
        torch.save(inputs[family], folder / f"{family}_inputs.pt")
        ours.append((roots[family] / converted / nemo, folder / f"{family}_inputs.pt",
                     folder / f"{family}_ours.pt"))  # fmt: skip
        theirs.append((hf_dir, folder / f"{family}_inputs.pt", folder / f"{family}_theirs.pt"))
    logits_of("portable_logits", ours)
    classes = logits_of("hf_logits", theirs).split()[-len(CONVERTED) :]
    return {
        family: (
            inputs[family],
            torch.load(folder / f"{family}_ours.pt"),
            torch.load(folder / f"{family}_theirs.pt"),
            chosen,
        )
        for family, chosen in zip(CONVERTED, classes, strict=True)
    }


def converts_to(converted: Path, family: str, logits: dict[str, tuple[Any, ...]]) -> Any:
    """transformers computes the logits of the model the conversion wrote, to 1e-4 in fp32
    (where the query is a token, not padding: megatron-core's masks give padded queries a
    uniform attention, transformers does not); returns its tokenizer, whose added tokens (the
    sentinels) are the model's ids."""
    from transformers import AutoTokenizer

    inputs, expected, computed, chosen = logits[family]
    assert chosen == CONVERTED[family][2]
    assert_same_outputs(expected, computed, inputs)
    hf_dir = converted / "hf"
    vocabulary = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    sentinels = tokenizer.convert_tokens_to_ids(["<extra_id_0>", "<extra_id_99>"])
    assert sentinels[1] - sentinels[0] == 99 and sentinels[1] < vocabulary, sentinels
    return tokenizer


def test_t5_tiny_learns_and_converts_through_main(
    t5_converted: Path, logits: dict[str, tuple[Any, ...]]
) -> None:
    assert_learns(t5_converted / "t5_tiny" / "results", 1.0)
    tokenizer = converts_to(t5_converted / "t5_tiny" / "convert_nemo", "t5", logits)
    # [BOS] and [EOS] follow the 2000 WordPieces; the sentinels follow them.
    assert tokenizer.convert_tokens_to_ids(["[BOS]", "[EOS]", "<extra_id_0>"]) == [2000, 2001, 2002]


def test_mt5_tiny_learns_and_converts_from_sentencepiece_data(
    mt5_converted: Path, logits: dict[str, tuple[Any, ...]]
) -> None:
    """mT5's kind of tokenizer: the default SentencePiece model, sentinels past its pieces."""
    assert_learns(mt5_converted / "mt5_tiny" / "results", 1.0)
    tokenizer = converts_to(mt5_converted / "mt5_tiny" / "convert_nemo", "mt5", logits)
    # [CLS], [SEP] and [MASK] follow the 8000 pieces; the sentinels follow them.
    assert tokenizer.convert_tokens_to_ids(["[CLS]", "<extra_id_0>"]) == [8000, 8003]


LAYOUT_STEPS = ("training.trainer.max_steps=6",)


@pytest.fixture(scope="module")
def single_process(prepared_wordpiece: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six steps on one process: the run the layouts are compared with (T5's relative bias,
    split over the tensor-parallel ranks by head)."""
    log_dir = tmp_path_factory.mktemp("t5_single") / "single"
    index = f"training.model.data.index_mapping_dir={log_dir.parent}/i"
    train(write_config(prepared_wordpiece, log_dir, *LAYOUT_STEPS, index))
    return log_dir


PP2 = (
    "training.model.pipeline_model_parallel_size=2",
    "training.model.pipeline_model_parallel_split_rank=1",
)
# Two encoder stages: each hands the next its hidden states, and both hold the encoder's
# relative bias table, whose gradients they sum.
PP3 = (
    "training.model.pipeline_model_parallel_size=3",
    "training.model.pipeline_model_parallel_split_rank=2",
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "processes"),
    [
        # TP 2 without sequence parallelism is not run apart: its relative bias split by head
        # is this run's, and its own path (all-reduces in place of the sequence's gathers and
        # scatters) is the published layout's TP 2 run's, below.
        (
            (
                "training.model.tensor_model_parallel_size=2",
                "training.model.sequence_parallel=true",
            ),
            2,
        ),
        # PP 2 is checked against one process by the published layout's run stopped and
        # resumed on two stages (copied embedding and output tables, 14 steps).
        ((*PP3, "training.model.optim.name=distributed_fused_adam"), 3),
    ],
    ids=["tp2-sequence-parallel", "pp3-distributed-optimizer"],
)
def test_t5_layouts_match_a_single_process(
    prepared_wordpiece: Path,
    single_process: Path,
    tmp_path: Path,
    layout: tuple[str, ...],
    processes: int,
) -> None:
    index = f"training.model.data.index_mapping_dir={single_process.parent}/i"
    parallel = write_config(
        prepared_wordpiece,
        tmp_path / "parallel",
        *LAYOUT_STEPS,
        index,
        f"training.trainer.devices={processes}",
        *layout,
    )
    train(parallel, processes=processes)
    assert_same_losses(single_process, tmp_path / "parallel", 1e-4)


# The published recipes' learned position table and output layer tied to the embedding (t5/tiny
# has T5 v1.1's relative bias and an output layer of its own), 14 steps, a checkpoint every 5.
PUBLISHED = (
    "training.model.position_embedding_type=learned_absolute",
    "training.model.share_decoder_tokens_head_embeddings=true",
    "training.trainer.max_steps=14",
    "training.exp_manager.checkpoint_callback_params.every_n_train_steps=5",
)


@dataclass(frozen=True)
class Stopped:
    """A run stopped by a signal, then started again with the same config."""

    exit_code: int
    last_step_before: int
    rerun_output: str


@dataclass(frozen=True)
class PublishedRuns:
    root: Path  # reference/ (uninterrupted, one process), resumed/ (one), pipeline/ (PP 2)
    stopped: dict[str, Stopped]

    def config(self, prepared: Path, name: str, *layout: str) -> Path:
        index = f"training.model.data.index_mapping_dir={self.root}/i"
        return write_config(prepared, self.root / name, *PUBLISHED, index, *layout)


RESUMED = {"resumed": (1, ()), "pipeline": (2, (*PP2, "training.trainer.devices=2"))}


@pytest.fixture(scope="module")
def published(prepared_wordpiece: Path, tmp_path_factory: pytest.TempPathFactory) -> PublishedRuns:
    """The published layout on one process, and the same stopped by a signal (once 3 steps are
    logged) and resumed, on one process and on two pipeline stages: the runs the published
    layout, stop-and-resume and conversion tests read."""
    runs = PublishedRuns(tmp_path_factory.mktemp("t5_published"), {})
    train(runs.config(prepared_wordpiece, "reference"))
    for name, (processes, layout) in RESUMED.items():
        config = runs.config(prepared_wordpiece, name, *layout)
        code = stop_with_signal(config, runs.root / name, processes)
        before = max(losses(runs.root / name))
        output = train(config, processes=processes).stdout
        runs.stopped[name] = Stopped(code, before, output)
    return runs


@pytest.mark.slow
def test_t5_published_layout_matches_at_tp2_and_pp2(
    prepared_wordpiece: Path, published: PublishedRuns
) -> None:
    """The published recipes' learned position table and output layer tied to the embedding
    (t5/tiny has T5 v1.1's relative bias and an output layer of its own): on two pipeline
    stages both tables are copies on the decoder's stage. The two stages' run is the
    stop-and-resume test's (stopped and resumed, it must still match the single process)."""
    layout = ("training.trainer.devices=2", "training.model.tensor_model_parallel_size=2")
    train(published.config(prepared_wordpiece, "tp2", *layout), processes=2)
    for name in ("tp2", "pipeline"):
        assert_same_losses(published.root / "reference", published.root / name, 1e-4)


@pytest.mark.slow
def test_t5_stop_and_resume_match_an_uninterrupted_run(published: PublishedRuns) -> None:
    """Stopped by a signal and resumed, on one process and on two pipeline stages (the
    published layout: its tables copied on the decoder's stage); the stages' checkpoint
    converts to a portable file that rebuilds the single-stage model exactly (in the
    conversion test, with the other checkpoint it converts)."""
    for name, tolerance in (("resumed", 0.0), ("pipeline", 1e-4)):
        processes = RESUMED[name][0]
        stopped = published.stopped[name]
        assert stopped.exit_code in (
            EXIT_PREEMPTED,
            # torchrun reports its workers' stop as its own failure; the checkpoint counts
            *(() if processes == 1 else (1, -signal.SIGTERM)),
        )
        assert stopped.last_step_before < 14
        assert "resumed from" in stopped.rerun_output
        assert_same_losses(published.root / "reference", published.root / name, tolerance)


@pytest.mark.slow
def test_a_t5_checkpoint_converts_to_one_file_and_reshards_exactly(
    prepared_wordpiece: Path, single_process: Path, published: PublishedRuns, tmp_path: Path
) -> None:
    """One process's checkpoint converts to a portable file that rebuilds it exactly at TP 2,
    PP 2 and one process; the two pipeline stages' checkpoint of the stop-and-resume test (its
    copied embedding stored once) converts to one that rebuilds the single-stage model
    exactly."""
    converted = {}
    for name, run in (("single", single_process), ("pipeline", published.root / "pipeline")):
        converted[name] = convert(
            prepared_wordpiece,
            run,
            tmp_path / name,
            "conversion=t5/convert_t5",
            "conversion.model.vocab_file=null",
        )
    assert not (tmp_path / "single" / "hf").exists()
    reshard_checks(
        (converted["single"], single_process, ((2, 1), (1, 2), (1, 1))),
        (converted["pipeline"], published.root / "pipeline", ((1, 1),)),
    )


def test_a_t5_decoder_on_several_pipeline_stages_is_one_line(
    prepared_wordpiece: Path, tmp_path: Path
) -> None:
    """t5/23b's split rank (PP / 2) at PP 4 would put the decoder on two stages."""
    result = run_main(
        "stages=[training]", "training=t5/tiny", f"data_dir={prepared_wordpiece}/data",
        "training.trainer.devices=4", "training.model.pipeline_model_parallel_size=4",
        f"base_results_dir={tmp_path / 'results'}",
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(
        "error: training.model.pipeline_model_parallel_split_rank: 2 must be PP - 1"
    )
    assert "Set it to 3" in line
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


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["training=t5/tiny"],
         ["conversion.model_family: gpt, but training.model is a t5 model",
          "conversion=t5/convert_t5"]),
        (["training=t5/tiny", "conversion=t5/convert_t5", *CONVERT_TO_HF,
          "training.model.position_embedding_type=learned_absolute"],
         ["training.model.position_embedding_type", "T5 v1.1"]),
        (["training=t5/tiny", "conversion=t5/convert_t5", *CONVERT_TO_HF,
          "training.model.share_decoder_tokens_head_embeddings=true"],
         ["training.model.share_decoder_tokens_head_embeddings", "bias"]),
        (["training=bert/tiny", "conversion=bert/convert_bert", "conversion.run.hf_dir_name=hf",
          "training.model.activation=geglu"],
         ["training.model.activation", "no Hugging Face BERT class"]),
    ],
    ids=["another-family", "t5-learned-positions", "t5-tied-head", "bert-geglu"],
)  # fmt: skip
def test_conversion_preflight_names_the_family_and_the_export(
    prepared_wordpiece: Path, tmp_path: Path, overrides: list[str], fragments: list[str]
) -> None:
    """Before anything runs: a conversion recipe of another family than the trained model's,
    and a Hugging Face export of a layout no transformers class computes."""
    result = run_main(
        "stages=[training,conversion]", "dry_run=true", f"data_dir={prepared_wordpiece}/data",
        f"base_results_dir={tmp_path / 'results'}", *overrides,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = result.stderr.strip().splitlines()
    assert all(fragment in line for fragment in fragments), line
