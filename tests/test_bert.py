"""BERT pretraining and conversion on megatron-core, for real on the CPU: the tiny recipe learns
and converts through `python3 main.py`, transformers computes the converted model's logits (post-
and pre-LN), the portable file rebuilds the model exactly at another TP/PP, TP2 / PP2 / sequence
parallelism give the single process's losses, a stopped run resumes exactly, and the recipe's
BERT keys are checked before anything runs."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from launcher_scripts.formats.progress import EXIT_PREEMPTED
from launcher_scripts.formats.tokenizer import wordpiece_reference
from tests.support import REPO
from tests.support.commands import run_main
from tests.support.conversion import convert, hf_computes_our_logits_each
from tests.support.training import (
    assert_same_losses,
    losses,
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


SAMPLE = REPO / "launcher_scripts" / "sample_data" / "tiny_corpus.jsonl.gz"
VOCAB = "data/custom_dataset/bpe/custom_sp_tokenizer.vocab.txt"  # under prepared_wordpiece


def write_config(prepared: Path, log_dir: Path, *overrides: str) -> Path:
    return write_training_config(prepared, log_dir, *SMALL, *overrides)


def bert_inputs() -> dict[str, Any]:
    """Two segments per row, the second row padded (id 0, padding_mask 0) after 30 tokens."""
    text = torch.randint(5, 2000, (3, 40), generator=torch.Generator().manual_seed(0))
    types = torch.zeros_like(text)
    types[:, 20:] = 1
    padding_mask = torch.ones_like(text)
    for tensor in (text, types, padding_mask):
        tensor[1, 30:] = 0
    return {"text": text, "types": types, "padding_mask": padding_mask}


@pytest.fixture(scope="module")
def through_main(prepared_wordpiece: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bert/tiny trained for 60 steps and converted (with its Hugging Face export) by
    `python3 main.py`: the results root."""
    results = tmp_path_factory.mktemp("bert_main")
    result = run_main(
        "stages=[training,conversion]",
        "training=bert/tiny",
        "conversion=bert/convert_bert",
        "conversion.run.hf_dir_name=hf",
        f"data_dir={prepared_wordpiece}/data",
        f"base_results_dir={results}",
        "training.trainer.max_steps=60",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return results


@pytest.fixture(scope="module")
def pre_ln(prepared_wordpiece: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pre-LN BERT trained two steps on one process (run/) and converted with its Hugging
    Face export (converted/): the folder."""
    folder = tmp_path_factory.mktemp("bert_pre_ln")
    steps = ("training.trainer.max_steps=2", "training.model.transformer_block_type=pre_ln")
    train(write_config(prepared_wordpiece, folder / "run", *steps))
    convert(
        prepared_wordpiece,
        folder / "run",
        folder / "converted",
        "conversion=bert/convert_bert",
        "conversion.run.hf_dir_name=hf",
    )
    return folder


@pytest.fixture(scope="module")
def hf_outputs(
    through_main: Path, pre_ln: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """transformers loads each export with no custom code and computes our logits on
    bert_inputs(): the post-LN model of main.py as BertForPreTraining, the pre-LN one as
    MegatronBertForPreTraining; and the pre-LN portable file rebuilds the trained model bit
    for bit at TP2 and at PP2 (conftest's hf_computes_our_logits_each with its `reshard`: our
    outputs of both models computed in the reshard check's launch, transformers' in one
    process). transformers' outputs of each."""
    converted = through_main / "bert_tiny" / "convert_nemo"
    cases = [
        (converted / "megatron_bert.nemo", converted / "hf", bert_inputs(), "BertForPreTraining"),
        (
            pre_ln / "converted" / "megatron_bert.nemo",
            pre_ln / "converted" / "hf",
            bert_inputs(),
            "MegatronBertForPreTraining",
        ),
    ]
    # The pre-LN file's reshard check (TP2, PP2) computes our outputs in its launch.
    reshard = (pre_ln / "converted" / "megatron_bert.nemo", pre_ln / "run", ((2, 1), (1, 2)))
    folder = tmp_path_factory.mktemp("bert_logits")
    post, pre = hf_computes_our_logits_each(cases, folder, reshard=reshard)
    return {"post_ln": post, "pre_ln": pre}


@pytest.mark.slow
def test_bert_tiny_learns_and_converts_through_main(
    prepared_wordpiece: Path, through_main: Path, hf_outputs: dict[str, dict[str, Any]]
) -> None:
    from transformers import BertForMaskedLM, BertTokenizer

    log_dir = through_main / "bert_tiny" / "results"
    curve = losses(log_dir)
    first, last = curve[min(curve)], curve[max(curve)]
    # From about ln(2048) + ln(2) (masked tokens and sentence order at chance) to well below.
    assert first > 7.5 and last < first - 0.8, curve
    assert (log_dir / "loss_curve.png").stat().st_size > 0
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["model_tflops_per_gpu"] > 0 for r in records if "model_tflops_per_gpu" in r)
    assert any((log_dir / "checkpoints").iterdir())

    # transformers loads the export with no custom code and computes our logits (hf_outputs);
    # its masked-LM class loads the same directory, and its tokenizer gives the ids the data
    # was prepared with.
    converted = through_main / "bert_tiny" / "convert_nemo"
    inputs = bert_inputs()
    computed = hf_outputs["post_ln"]
    assert set(computed) == {"logits", "order"}
    masked_lm = BertForMaskedLM.from_pretrained(converted / "hf").eval()
    with torch.no_grad():
        logits = masked_lm(
            input_ids=inputs["text"],
            attention_mask=inputs["padding_mask"],
            token_type_ids=inputs["types"],
        ).logits
    assert (logits - computed["logits"]).abs().max().item() <= 1e-5
    tokenizer = BertTokenizer.from_pretrained(converted / "hf")
    reference = wordpiece_reference(str(prepared_wordpiece / VOCAB), lower_case=True)
    with gzip.open(SAMPLE, "rt") as lines:
        texts = [json.loads(line)["text"] for _, line in zip(range(20), lines, strict=False)]
    assert [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts] == [
        reference.encode(t).ids for t in texts
    ]


@pytest.mark.slow
def test_pre_ln_bert_converts_to_megatron_bert_and_reshards_exactly(
    pre_ln: Path, hf_outputs: dict[str, dict[str, Any]]
) -> None:
    """megatron-core's own layout is transformers' MegatronBert; the portable file rebuilds the
    trained model bit for bit at TP2 and at PP2."""
    # hf_outputs made both checks: transformers computed our logits as
    # MegatronBertForPreTraining, and the file was rebuilt exactly at TP2 and at PP2.
    assert set(hf_outputs["pre_ln"]) == {"logits", "order"}
    assert (pre_ln / "converted" / "megatron_bert.nemo").is_file()


LAYOUT_STEPS = ("training.trainer.max_steps=6",)


@pytest.fixture(scope="module")
def single_process(prepared_wordpiece: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six steps on one process: the run every layout is compared with."""
    log_dir = tmp_path_factory.mktemp("bert_single") / "single"
    index = f"training.model.data.index_mapping_dir={log_dir.parent}/i"
    train(write_config(prepared_wordpiece, log_dir, *LAYOUT_STEPS, index))
    return log_dir


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
