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

from tests.support import REPO
from tests.support.commands import run_main
from tests.support.conversion import convert, hf_computes_our_logits_each, run_conversion_job
from tests.support.training import train, write_small_gpt_config

IMPROVED = (
    "training.model.position_embedding_type=rope",
    "training.model.activation=swiglu",
    "training.model.normalization=layernorm1p",
    "training.model.bias=false",
    "training.model.share_embeddings_and_output_weights=false",
    "training.model.num_attention_heads=4",
    "+training.model.num_query_groups=2",
)
TP2_PP2 = (
    "training.trainer.devices=4",
    "training.model.tensor_model_parallel_size=2",
    "training.model.pipeline_model_parallel_size=2",
    "training.model.global_batch_size=2",
    "training.model.micro_batch_size=1",
)
# Each variant's training: the gpt2-style one (the recipe's own architecture) is the TP2 x PP2
# run, so one checkpoint both converts back exactly at other layouts and exports to
# transformers (a sharded checkpoint is the harder export); the improved one trains alone.
VARIANTS = {
    "gpt2-style": ("training.trainer.max_steps=2", *TP2_PP2),
    "improved": ("training.trainer.max_steps=4", *IMPROVED),
}
ARCHITECTURES = {"gpt2-style": "GPT2LMHeadModel", "improved": "StableLmForCausalLM"}
SAMPLE = REPO / "launcher_scripts" / "sample_data" / "tiny_corpus.jsonl.gz"


@pytest.fixture(scope="module")
def converted(prepared: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each variant trained and converted to the portable file and a Hugging Face directory
    (<variant>/run, <variant>/converted): the folder of each."""
    folders = {}
    for variant, overrides in VARIANTS.items():
        folder = tmp_path_factory.mktemp(variant)
        run = folder / "run"
        processes = 4 if variant == "gpt2-style" else 1
        train(write_small_gpt_config(prepared, run, *overrides), processes=processes)
        convert(prepared, run, folder / "converted")
        folders[variant] = folder
    return folders


@pytest.fixture(scope="module")
def hf_outputs(
    converted: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict]:
    """transformers on each variant's export computes our logits; and the TP2 x PP2 run's
    portable file is, at TP2 x PP2 and at TP1, bit for bit the model its checkpoint loads
    (conftest's hf_computes_our_logits_each with its `reshard`: our outputs of every variant
    computed in the reshard check's launch, transformers' in one process)."""
    tokens = torch.randint(1, 8000, (2, 48), generator=torch.Generator().manual_seed(0))
    cases = [
        (
            converted[v] / "converted" / "megatron_gpt.nemo",
            converted[v] / "converted" / "hf",
            {"tokens": tokens},
            ARCHITECTURES[v],
        )
        for v in VARIANTS
    ]
    # The TP2 x PP2 file's reshard check computes our outputs in its launch.
    folder = converted["gpt2-style"]
    reshard = (folder / "converted" / "megatron_gpt.nemo", folder / "run", ((2, 2), (1, 1)))
    outputs = hf_computes_our_logits_each(cases, tmp_path_factory.mktemp("logits"), reshard=reshard)
    return dict(zip(VARIANTS, outputs, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_transformers_loads_the_export_and_matches_our_logits(
    converted: dict[str, Path], hf_outputs: dict[str, dict], variant: str
) -> None:
    from transformers import LlamaTokenizer

    model_file = converted[variant] / "converted" / "megatron_gpt.nemo"
    with tarfile.open(model_file) as tar:
        assert sorted(tar.getnames()) == [
            "model_config.yaml",
            "model_weights.safetensors",
            "tokenizer/custom_sp_tokenizer.model",
        ]

    hf_dir = converted[variant] / "converted" / "hf"
    # transformers loaded it as ARCHITECTURES[variant] and computed our logits (hf_outputs).
    assert set(hf_outputs[variant]) == {"logits"}

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


@pytest.mark.slow
def test_a_tp2_pp2_checkpoint_converts_to_one_file_and_back_exactly(
    converted: dict[str, Path], hf_outputs: dict[str, dict], tiny_portable: Path
) -> None:
    # The gpt2-style run was trained at TP2 x PP2 on four processes; hf_outputs checked that
    # its one converted file rebuilds it exactly at TP2 x PP2 and at TP1 (assert_reshards_
    # exactly's check, in the launch that also computed the variants' logits).
    folder = converted["gpt2-style"]
    assert (folder / "converted" / "megatron_gpt.nemo").is_file()
    assert "gpt2-style" in hf_outputs
    # conversion.run.hf_dir_name=null writes no Hugging Face directory: the session's tiny
    # model was converted so (through main.py), where the export would otherwise be.
    assert tiny_portable.is_file()
    assert not (tiny_portable.parent / "hf").exists()


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


@pytest.mark.slow
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
