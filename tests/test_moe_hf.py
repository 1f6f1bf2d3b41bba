"""Hugging Face mixture-of-experts models in and out: tiny random MixtralForCausalLM,
Qwen2MoeForCausalLM and Qwen3MoeForCausalLM that transformers itself builds and saves
(tests/scripts/make_hf_gpt.py), imported through `python3 main.py conversion=hf_import`.

Our logits equal transformers' to 1e-5 in fp32 at TP1, TP2 and EP2, greedy generation gives
its tokens, and the file written back is the original checkpoint tensor for tensor, as the
original class. From an imported Mixtral: continued pretraining at EP2 (its conversion back to
a Hugging Face Mixtral), and LoRA at EP2, exported to Hugging Face merged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# The families register the tensor shapes the portable file checks compare weights with.
import launcher_scripts.families  # noqa: F401
from tests.support.commands import run_main, run_module
from tests.support.conversion import (
    architecture_overrides,
    checks,
    continued_on_cpu,
    hf_imported,
    prepared_with,
)
from tests.support.sft_task import write_mapping_task

CLASSES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hf_moe") / "models"
    run_module("tests.scripts.make_hf_gpt", str(folder), *CLASSES)
    return folder


@pytest.fixture(scope="module")
def imported_moe(hf_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    results = tmp_path_factory.mktemp("imported_moe")
    return {variant: hf_imported(hf_moe / variant, results) for variant in CLASSES}


def assert_computes_what_transformers_does(report: dict) -> None:
    assert report["logits"] <= 1e-5, report
    ours, theirs = report["greedy"]
    assert ours == theirs and any(len(tokens) > 1 for tokens in ours), report
    assert report["token_ids"], report


@pytest.mark.slow
def test_imported_moe_models_compute_what_transformers_does_and_go_back_exactly(
    hf_moe: Path, imported_moe: dict[str, Path], tmp_path: Path
) -> None:
    one = [(imported_moe[v], hf_moe / v, tmp_path / v, 1, 1) for v in CLASSES]
    for variant, report in zip(CLASSES, checks(*one), strict=True):
        assert_computes_what_transformers_does(report)
        assert report["keys_equal"] and report["tensors_equal"], (variant, report)
        assert report["class"] == CLASSES[variant], (variant, report)
    # Two processes: TP 2 (each expert's MLP split), then EP 2 (two experts a rank, the
    # tokens crossing in the dispatcher's all-to-all).
    two = [(imported_moe[v], hf_moe / v, "-", layout, 1) for layout in (2, "1:2") for v in CLASSES]
    for report in checks(*two):
        assert_computes_what_transformers_does(report)


def test_an_imported_moe_models_section_states_its_experts(imported_moe: dict[str, Path]) -> None:
    from launcher_scripts.formats import portable

    mixtral = portable.read_config(imported_moe["mixtral"])
    assert (mixtral.num_moe_experts, mixtral.moe_router_topk) == (4, 2)
    assert not mixtral.moe_router_pre_softmax
    qwen = portable.read_config(imported_moe["qwen2_moe"])
    assert (qwen.num_moe_experts, qwen.moe_ffn_hidden_size) == (6, 32)
    assert qwen.moe_shared_expert_intermediate_size == 80 and qwen.moe_shared_expert_gate
    assert qwen.moe_router_pre_softmax and qwen.qkv_bias  # norm_topk_prob false: not renormalised
    qwen3 = portable.read_config(imported_moe["qwen3_moe"])
    assert qwen3.qk_layernorm and qwen3.kv_channels == 24 and not qwen3.moe_router_pre_softmax
    assert not qwen3.get("moe_shared_expert_intermediate_size")


@pytest.mark.slow
def test_lora_on_an_imported_mixtral_at_ep2_goes_back_to_hugging_face_merged(
    hf_moe: Path, imported_moe: dict[str, Path], tmp_path: Path
) -> None:
    """`peft=mixtral/8x7b_squad` (LoRA on attention) from the imported file at EP 2, then
    `conversion=hf_export` with the LoRA file folded in: a MixtralForCausalLM whose attention
    moved and whose experts are the original ones."""
    task = write_mapping_task(tmp_path / "task")
    results, data = tmp_path / "results", "peft.model.data"
    tuned = run_main(
        "stages=[peft]",
        "peft=mixtral/8x7b_squad",
        f"base_results_dir={results}",
        "peft.run.model_train_name=mixtral",
        f"peft.model.restore_from_path={imported_moe['mixtral']}",
        f"{data}.train_ds.file_names=[{task['train']}]",
        f"{data}.validation_ds.file_names=[{task['val']}]",
        f"{data}.test_ds.file_names=[{task['test']}]",
        f"{data}.train_ds.max_seq_length=32",
        "peft.trainer.accelerator=cpu",
        "peft.trainer.precision=32",
        "peft.trainer.devices=2",
        "peft.model.expert_model_parallel_size=2",
        "peft.trainer.max_steps=30",
        "peft.trainer.val_check_interval=30",
        "peft.trainer.log_every_n_steps=10",
        "peft.model.global_batch_size=4",
        "peft.model.micro_batch_size=2",
        "peft.model.optim.lr=1e-2",
        "peft.model.optim.sched.warmup_steps=2",
        timeout=900,
    )
    assert tuned.returncode == 0, tuned.stdout[-3000:] + tuned.stderr[-3000:]
    log = results / "mixtral" / "peft_squad" / "results"
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    losses = [r["val_loss"] for r in rows if "val_loss" in r]
    assert losses[-1] < losses[0] - 0.5, losses
    assert any("moe_load_balancing_loss" in r for r in rows)
    lora = log / "checkpoints" / "megatron_gpt_peft_lora.nemo"
    exported = run_main(
        "stages=[conversion]",
        "conversion=hf_export",
        f"conversion.nemo_file={imported_moe['mixtral']}",
        "conversion.run.model_train_name=mixtral",
        f"conversion.peft_file={lora}",
        f"conversion.run.output_path={tmp_path / 'back'}",
        f"base_results_dir={results}",
    )
    assert exported.returncode == 0, exported.stdout[-3000:] + exported.stderr[-3000:]
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"], config
    from safetensors.torch import load_file

    original = load_file(hf_moe / "mixtral" / "model.safetensors")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(original) == sorted(back)
    changed = sorted(k for k in original if not (original[k] == back[k]).all())
    assert changed and all("self_attn" in k for k in changed), changed


def test_a_moe_files_config_and_experts_must_agree(
    imported_moe: dict[str, Path], tmp_path: Path
) -> None:
    """The portable file's shape check covers the experts: a model_config.yaml that says 8
    experts over weights of 4 is refused naming the keys."""
    from launcher_scripts.formats.portable_check import PortableFileError, inspect_portable
    from tests.support.damaged_files import with_config

    wrong = with_config(imported_moe["mixtral"], tmp_path / "wrong.nemo", num_moe_experts=8)
    with pytest.raises(PortableFileError, match="num_moe_experts"):
        inspect_portable(wrong)


@pytest.mark.slow
def test_continued_pretraining_and_sft_from_an_imported_mixtral_at_ep2(
    hf_moe: Path, imported_moe: dict[str, Path], tmp_path: Path
) -> None:
    """Text prepared with the imported Mixtral's own tokenizer, `training=mixtral/8x7b` from
    the file at EP 2 and converted back to a Hugging Face Mixtral (at a learning rate of 1e-12
    the weights stay the imported ones); and `fine_tuning=mixtral/8x7b_squad` (every weight,
    the experts' too) at EP 2, which learns the task."""
    start = imported_moe["mixtral"]
    results, data = tmp_path / "results", tmp_path / "data"
    corpus = tmp_path / "corpus.jsonl"
    lines = ["The river runs north past the market.", "Winter mornings are quiet here."] * 4
    corpus.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    continued = run_main(
        "stages=[data_preparation,training,conversion]",
        *prepared_with(hf_moe / "mixtral" / "tokenizer.json", corpus, data),
        "training=mixtral/8x7b",
        "training.run.hf_model_name=mixtral",
        f"training.model.restore_from_path={start}",
        *architecture_overrides(start),
        *continued_on_cpu(data),
        "training.model.pipeline_model_parallel_size=1",
        "training.model.expert_model_parallel_size=2",
        "training.model.moe_grouped_gemm=False",
        f"base_results_dir={results}",
        timeout=900,
    )
    assert continued.returncode == 0, continued.stdout[-3000:] + continued.stderr[-3000:]
    assert f"starting from the weights of {start}" in continued.stdout
    converted = results / "mixtral_8x7b_continued" / "convert_nemo"
    exported = json.loads((converted / "hf" / "config.json").read_text())
    assert exported["architectures"] == ["MixtralForCausalLM"], exported
    from safetensors.torch import load_file

    original = load_file(hf_moe / "mixtral" / "model.safetensors")
    back = load_file(converted / "hf" / "model.safetensors")
    assert sorted(original) == sorted(back)
    assert max(float((original[k] - back[k]).abs().max()) for k in original) < 1e-9

    task = write_mapping_task(tmp_path / "task")
    data_keys = "fine_tuning.model.data"
    tuned = run_main(
        "stages=[fine_tuning]",
        "fine_tuning=mixtral/8x7b_squad",
        f"base_results_dir={results}",
        "fine_tuning.run.model_train_name=mixtral",
        f"fine_tuning.model.restore_from_path={start}",
        f"{data_keys}.train_ds.file_names=[{task['train']}]",
        f"{data_keys}.validation_ds.file_names=[{task['val']}]",
        f"{data_keys}.test_ds.file_names=[{task['test']}]",
        f"{data_keys}.train_ds.max_seq_length=32",
        "fine_tuning.trainer.accelerator=cpu",
        "fine_tuning.trainer.precision=32",
        "fine_tuning.trainer.num_nodes=1",
        "fine_tuning.trainer.devices=2",
        "fine_tuning.model.pipeline_model_parallel_size=1",
        "fine_tuning.model.expert_model_parallel_size=2",
        "fine_tuning.trainer.max_steps=30",
        "fine_tuning.trainer.val_check_interval=30",
        "fine_tuning.trainer.log_every_n_steps=10",
        "fine_tuning.model.global_batch_size=4",
        "fine_tuning.model.micro_batch_size=2",
        "fine_tuning.model.optim.lr=1e-3",
        "fine_tuning.model.optim.sched.warmup_steps=2",
        timeout=900,
    )
    assert tuned.returncode == 0, tuned.stdout[-3000:] + tuned.stderr[-3000:]
    log = results / "mixtral" / "squad" / "results"
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    losses = [r["val_loss"] for r in rows if "val_loss" in r]
    assert losses[-1] < losses[0] - 0.5, losses
