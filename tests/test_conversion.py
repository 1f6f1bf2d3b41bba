"""Conversion: a training checkpoint to the portable file and the Hugging Face directory, for
real. transformers loads the export with no custom code and computes our model's logits; the
portable file rebuilds the trained model exactly at another TP/PP."""

from __future__ import annotations

import gzip
import json
import shutil
import tarfile
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    REPO,
    assert_hf_computes_our_logits,
    assert_reshards_exactly,
    convert,
    run_conversion_job,
    run_main,
    train,
)
from tests.test_training import write_config

IMPROVED = (
    "training.model.position_embedding_type=rope",
    "training.model.activation=swiglu",
    "training.model.normalization=layernorm1p",
    "training.model.bias=false",
    "training.model.share_embeddings_and_output_weights=false",
    "training.model.num_attention_heads=4",
    "+training.model.num_query_groups=2",
)
VARIANTS = {"gpt2-style": (), "improved": IMPROVED}
SAMPLE = REPO / "launcher_scripts" / "sample_data" / "tiny_corpus.jsonl.gz"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_transformers_loads_the_export_and_matches_our_logits(
    prepared: Path, tmp_path: Path, variant: str
) -> None:
    from transformers import LlamaTokenizer

    run = tmp_path / "run"
    train(write_config(prepared, run, "training.trainer.max_steps=4", *VARIANTS[variant]))
    model_file = convert(prepared, run, tmp_path / "converted")
    with tarfile.open(model_file) as tar:
        assert sorted(tar.getnames()) == [
            "model_config.yaml",
            "model_weights.safetensors",
            "tokenizer/custom_sp_tokenizer.model",
        ]

    hf_dir = tmp_path / "converted" / "hf"
    tokens = torch.randint(1, 8000, (2, 48), generator=torch.Generator().manual_seed(0))
    expected = "GPT2LMHeadModel" if variant == "gpt2-style" else "StableLmForCausalLM"
    assert_hf_computes_our_logits(model_file, hf_dir, {"tokens": tokens}, expected, tmp_path)

    # The tokenizer gives the ids training saw, on text of the corpus it was trained on.
    import sentencepiece

    # The class the export names (AutoTokenizer picks another one for StableLM directories).
    tokenizer = LlamaTokenizer.from_pretrained(hf_dir)
    reference = sentencepiece.SentencePieceProcessor(model_file=str(hf_dir / "tokenizer.model"))
    with gzip.open(SAMPLE, "rt") as lines:
        texts = [json.loads(line)["text"] for _, line in zip(range(40), lines, strict=False)]
    # Known difference: transformers drops characters SentencePiece maps to <unk>.
    known = [t for t in texts if reference.unk_id() not in reference.encode(t)]
    assert len(known) >= 10
    assert [tokenizer(t)["input_ids"] for t in known] == [reference.encode(t) for t in known]


def test_a_tp2_pp2_checkpoint_converts_to_one_file_and_back_exactly(
    prepared: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    layout = (
        "training.trainer.devices=4",
        "training.model.tensor_model_parallel_size=2",
        "training.model.pipeline_model_parallel_size=2",
        "training.model.global_batch_size=2",
        "training.model.micro_batch_size=1",
    )
    train(write_config(prepared, run, "training.trainer.max_steps=2", *layout), processes=4)
    model_file = convert(prepared, run, tmp_path / "converted", "conversion.run.hf_dir_name=null")
    assert not (tmp_path / "converted" / "hf").exists()
    assert_reshards_exactly(model_file, run, ((2, 2), (1, 1)))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["stages=[conversion]", "conversion.run.model_train_name=never_trained"],
            "error: conversion.model.checkpoint_folder: ",
        ),
        (
            ["stages=[training,conversion]", "training.model.activation=squared-relu"],
            "error: training.model.activation: 'squared-relu' with learned position embeddings",
        ),
        (
            ["stages=[training,conversion]", "conversion.model.tensor_model_parallel_size=3"],
            "error: conversion.model.tensor_model_parallel_size: 3 does not divide",
        ),
        (
            ["stages=[training,conversion]", "+training.model.kv_channels=16"],
            "error: training.model.kv_channels: 16 per head x 4 heads != hidden 128",
        ),
    ],
    ids=["no-checkpoint", "no-hf-architecture", "bad-layout", "head-size"],
)
def test_conversion_preflight_is_one_line(
    prepared: Path, tmp_path: Path, overrides: list[str], message: str
) -> None:
    result = run_main(
        f"data_dir={prepared}/data", f"base_results_dir={tmp_path}/results", *overrides
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(message), result.stderr
    assert not (tmp_path / "results").exists()


def test_a_damaged_checkpoint_is_refused_in_one_line(tiny_portable: Path, tmp_path: Path) -> None:
    """A shard cut short or a file missing: conversion names the checkpoint and the fix, in
    preflight (exit 2, nothing written) and in the job."""
    trained = tiny_portable.parents[1] / "results"
    folder = tmp_path / "checkpoints"
    shutil.copytree(trained / "checkpoints", folder)
    [newest] = folder.iterdir()
    older = folder / newest.name.replace("step=60", "step=30")
    shutil.copytree(newest, older)
    state = json.loads((older / "train_state.json").read_text())
    (older / "train_state.json").write_text(json.dumps({**state, "step": 30}))
    shard = sorted(newest.glob("*.distcp"))[0]
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 3])
    paths = (
        f"base_results_dir={tmp_path}/results",
        f"conversion.model.checkpoint_folder={folder}",
        f"conversion.model.hparams_file={trained / 'hparams.yaml'}",
        f"conversion.run.output_path={tmp_path}/out",
    )

    result = run_main("stages=[conversion]", *paths)

    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(
        f"error: conversion.model.checkpoint_name: checkpoint {newest} is damaged (its file "
        f"{shard.name} has {size // 3} bytes, {size} when it was saved)"
    ), line
    assert f"conversion.model.checkpoint_name='{older.name}'" in line
    assert not (tmp_path / "results").exists() and not (tmp_path / "out").exists()
    # The job itself, for a run whose preflight could not look: the same line, exit 1.
    (older / "common.pt").unlink()
    job = run_conversion_job(["stages=[conversion]", *paths], tmp_path / "convert.yaml", 300)
    assert job.returncode == 1, job.stdout + job.stderr
    assert "Traceback" not in job.stderr
    last = job.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: checkpoint {newest} is damaged"), last
    assert "conversion.model.checkpoint_name" not in last  # no complete one left to suggest
    assert not (tmp_path / "out" / "megatron_gpt.nemo").exists()
