"""Mixture-of-experts pretraining on megatron-core, for real on the CPU (gloo): the tiny MoE GPT
learns and logs its routing, expert and tensor parallelism give the single process's losses,
stop and resume is exact (across a change of EP too), and a layout megatron-core cannot train
is refused in preflight naming the key."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from launcher_scripts import pipeline
from launcher_scripts.config.compose import compose_config
from launcher_scripts.errors import ConfigError
from launcher_scripts.formats.progress import EXIT_PREEMPTED
from tests.support.training import (
    assert_same_losses,
    losses,
    stop_with_signal,
    train,
    write_training_config,
)

MOE = "training=gpt3/tiny_moe"
# Short runs compared step by step: a vocabulary padded alike at TP 1 and 2, one index cache.
SHORT = (
    MOE,
    "training.trainer.max_steps=6",
    "training.model.optim.sched.warmup_steps=2",
    "training.trainer.log_every_n_steps=1",
    "training.trainer.val_check_interval=3",
    "training.trainer.limit_val_batches=1",
    "training.model.make_vocab_size_divisible_by=4096",
)


def records(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def moe_runs(prepared: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The single-process run the parallel layouts are compared with, and the index cache."""
    folder = tmp_path_factory.mktemp("moe")
    index = f"training.model.data.index_mapping_dir={folder}/i"
    train(write_training_config(prepared, folder / "single", *SHORT, index))
    biased = ("training.model.bias=true",)
    train(write_training_config(prepared, folder / "single-biased", *SHORT, *biased, index))
    return folder


@pytest.mark.slow
def test_the_tiny_moe_gpt_learns_and_logs_its_routing(prepared: Path, tmp_path: Path) -> None:
    result = train(
        write_training_config(prepared, tmp_path / "run", MOE, "training.trainer.max_steps=40")
    )
    trained = losses(tmp_path / "run")
    assert trained[40] < trained[10] - 1.5, trained
    logged = [r for r in records(tmp_path / "run") if "reduced_train_loss" in r]
    for record in logged:
        # 1.0 is a perfectly even split; the Switch balancing loss is 1.0 when even, at least
        # top_k / experts x experts = 1 ... here its floor is 1 for any routing (Switch eq. 4).
        assert 0 <= record["moe_load_min"] <= 1 <= record["moe_load_max"] <= 2, record
        assert record["moe_load_balancing_loss"] >= 1 - 1e-6, record
        assert record["moe_z_loss"] > 0, record
    assert (tmp_path / "run" / "expert_load.png").stat().st_size > 0
    assert "expert load:" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "reference", "tolerance"),
    [
        # Each rank holds 2 of the 4 experts; the tokens cross in an all-to-all. Biased experts
        # (megatron-core's local expert MLP adds the bias in place: jobs/models/transformer.py).
        (
            ("training.model.expert_model_parallel_size=2", "training.model.bias=true"),
            "single-biased",
            1e-4,
        ),
        # TP 2 with sequence parallelism, each expert split over both ranks. The sums of the
        # split matmuls differ in the last bits, and a router's top-2 choice between two near
        # scores can follow them: a few tokens routed elsewhere by step 6 move the loss ~1e-3.
        (
            (
                "training.model.tensor_model_parallel_size=2",
                "training.model.sequence_parallel=true",
            ),
            "single",
            5e-3,
        ),
    ],
    ids=["ep2", "tp2-etp2"],
)
def test_expert_and_tensor_parallel_moe_match_a_single_process(
    prepared: Path,
    moe_runs: Path,
    tmp_path: Path,
    layout: tuple[str, ...],
    reference: str,
    tolerance: float,
) -> None:
    index = f"training.model.data.index_mapping_dir={moe_runs}/i"
    parallel = write_training_config(
        prepared, tmp_path / "parallel", *SHORT, index, "training.trainer.devices=2", *layout
    )
    train(parallel, processes=2)
    assert_same_losses(moe_runs / reference, tmp_path / "parallel", tolerance)


STOP_AND_RESUME = (
    MOE,
    "training.trainer.max_steps=16",
    "training.exp_manager.checkpoint_callback_params.every_n_train_steps=8",
    "training.trainer.log_every_n_steps=1",
    "training.trainer.val_check_interval=8",
)


@pytest.mark.slow
@pytest.mark.parametrize("first_ep", [1, 2], ids=["same-layout", "ep2-then-ep1"])
def test_moe_stop_and_resume_match_an_uninterrupted_run(
    prepared: Path, tmp_path: Path, first_ep: int
) -> None:
    index = f"training.model.data.index_mapping_dir={tmp_path}/i"
    train(write_training_config(prepared, tmp_path / "reference", *STOP_AND_RESUME, index))
    first = write_training_config(
        prepared,
        tmp_path / "resumed",
        *STOP_AND_RESUME,
        index,
        f"training.trainer.devices={first_ep}",
        f"training.model.expert_model_parallel_size={first_ep}",
    )
    assert stop_with_signal(first, tmp_path / "resumed", first_ep) in (
        EXIT_PREEMPTED,
        *(() if first_ep == 1 else (1, -signal.SIGTERM)),
    )
    assert max(losses(tmp_path / "resumed")) < 16
    second = write_training_config(prepared, tmp_path / "resumed", *STOP_AND_RESUME, index)
    assert "resumed from" in train(second).stdout
    assert_same_losses(tmp_path / "reference", tmp_path / "resumed", 0.0 if first_ep == 1 else 1e-4)


@pytest.mark.parametrize(
    ("overrides", "key", "fix"),
    [
        (
            ["training.trainer.devices=3", "training.model.expert_model_parallel_size=3"],
            "training.model.expert_model_parallel_size",
            "divisor of num_moe_experts",
        ),
        (
            [
                "training.trainer.devices=2",
                "training.model.tensor_model_parallel_size=2",
            ],
            "training.model.sequence_parallel",
            "sequence_parallel=true",
        ),
        (
            [
                "training.trainer.devices=2",
                "training.model.tensor_model_parallel_size=2",
                "training.model.sequence_parallel=true",
                "training.model.bias=true",
            ],
            "training.model.expert_tensor_parallel_size",
            "expert_tensor_parallel_size=1",
        ),
        (["training.model.moe_router_topk=5"], "training.model.moe_router_topk", "at most 4"),
        (
            ["training.model.moe_router_topk=1"],
            "training.model.moe_router_pre_softmax",
            "moe_router_pre_softmax=true",
        ),
        (
            ["training.model.moe_layer_freq=[1,0,1]"],
            "training.model.moe_layer_freq",
            "4 zeros and ones",
        ),
        (
            ["training.model.moe_token_dispatcher_type=flex"],
            "training.model.moe_token_dispatcher_type",
            "alltoall",
        ),
        (
            ["training.trainer.devices=4", "training.model.expert_model_parallel_size=8"],
            "training.model.expert_model_parallel_size",
            "divides num_nodes x devices",
        ),
    ],
)
def test_a_moe_layout_megatron_cannot_train_is_refused_naming_the_key(
    tmp_path: Path, overrides: list[str], key: str, fix: str
) -> None:
    refusal = refused(tmp_path, MOE, *overrides)
    assert refusal.key == key, refusal
    assert fix in str(refusal)


def refused(tmp_path: Path, *overrides: str) -> ConfigError:
    """The dry run's preflight refusal of the training stage with these overrides."""
    cfg = compose_config(
        [
            "stages=[training]",
            f"data_dir={tmp_path}/data",
            f"base_results_dir={tmp_path}/results",
            "dry_run=true",
            *overrides,
        ]
    )
    with pytest.raises(ConfigError) as refusal:
        pipeline.plan(cfg)
    return refusal.value


@pytest.mark.slow
def test_the_tiny_t5_with_switch_experts_learns(prepared_wordpiece: Path, tmp_path: Path) -> None:
    """t5/tiny_moe (the NeMo launcher's T5 mixture of experts): top-1 experts in every other
    encoder and decoder layer; both stacks' routing is logged and plotted."""
    result = train(
        write_training_config(
            prepared_wordpiece,
            tmp_path / "run",
            "training=t5/tiny_moe",
            "training.trainer.max_steps=40",
            "training.trainer.val_check_interval=40",
        )
    )
    trained = losses(tmp_path / "run")
    assert trained[40] < trained[10] - 1.0, trained
    logged = [r for r in records(tmp_path / "run") if "reduced_train_loss" in r]
    assert all(r["moe_load_balancing_loss"] >= 1 - 1e-6 for r in logged), logged
    assert "expert load:" in result.stdout


def test_t5_experts_under_tensor_parallelism_are_refused(tmp_path: Path) -> None:
    tensor = ("training.trainer.devices=2", "training.model.tensor_model_parallel_size=2")
    refusal = refused(tmp_path, "training=t5/tiny_moe", *tensor)
    assert refusal.key == "training.model.tensor_model_parallel_size"
    assert "training.model.encoder has experts" in str(refusal)


def test_expert_parallelism_on_a_dense_model_is_refused(tmp_path: Path) -> None:
    expert = ("training.trainer.devices=2", "+training.model.expert_model_parallel_size=2")
    refusal = refused(tmp_path, "training=gpt3/tiny", *expert)
    assert refusal.key == "training.model.expert_model_parallel_size"
    assert "no experts" in str(refusal)


@pytest.mark.slow
def test_a_deepseek_style_stack_converts_and_its_hf_export_is_refused(
    prepared: Path, tmp_path: Path
) -> None:
    """A dense first layer, then experts with a shared expert (DeepSeekMoE's layout): megatron-
    core keeps such a stack's layers apart; the conversion writes them into a portable file
    whose shapes check, and the Hugging Face export (no transformers class holds it) is refused
    in one line naming the key."""
    from launcher_scripts.formats.portable_check import inspect_portable
    from tests.support.commands import run_main

    deepseek = (
        "training.model.moe_layer_freq=[0,1,1,1]",
        "training.model.moe_shared_expert_intermediate_size=128",
        "training.trainer.max_steps=2",
        "training.model.optim.sched.warmup_steps=1",
    )
    paths = (f"data_dir={prepared}/data", f"base_results_dir={tmp_path}")
    result = run_main("stages=[training,conversion]", MOE, *deepseek, *paths)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "moe_layer_freq: experts in only some layers" in result.stderr
    result = run_main(
        "stages=[training,conversion]", MOE, *deepseek, *paths, "conversion.run.hf_dir_name=null"
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    converted = tmp_path / "gpt3_tiny_moe" / "convert_nemo" / "megatron_gpt.nemo"
    shapes = inspect_portable(converted).shapes
    assert "decoder.layers.0.mlp.linear_fc1.weight" in shapes  # the dense first layer
    assert shapes["decoder.layers.3.mlp.experts.experts.linear_fc1.weight"] == (4, 512, 128)
    assert "decoder.layers.3.mlp.shared_experts.gate_weight" not in shapes  # no gate asked
