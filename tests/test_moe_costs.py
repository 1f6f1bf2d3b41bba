"""The cost model's mixture-of-experts terms against hand derivations (launcher_scripts/costmodel/
memory.py and throughput.py cite the formulas), and the published MoE recipes' parameter counts
against the published figures."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from launcher_scripts.config.compose import compose_config
from launcher_scripts.costmodel.memory import (
    bytes_per_parameter,
    dispatch_bytes,
    layer_activation_bytes,
    memory_breakdown,
    stage_expert_parameters,
    stage_parameters,
)
from launcher_scripts.costmodel.throughput import (
    ClusterSpec,
    expert_dispatch_seconds,
    model_flops_per_sample,
    predict_step,
)
from launcher_scripts.families import family_of
from launcher_scripts.recipes.layout import Layout
from launcher_scripts.recipes.model_shape import EXPERT_ARCHITECTURE_KEYS, Experts, ModelShape
from launcher_scripts.recipes.restore import ARCHITECTURE_DEFAULTS

# 4 layers, hidden 64, 4 heads, SwiGLU, no biases, untied; 8 experts of width 32, top 2, one
# shared expert of width 48 with a gate, every layer MoE but the first.
H, S, V, E, K, FE, FS = 64, 16, 1024, 8, 2, 32, 48
SHAPE = ModelShape(
    num_layers=4,
    hidden_size=H,
    ffn_hidden_size=128,
    num_attention_heads=4,
    seq_length=S,
    vocab_size=V,
    gated_mlp=True,
    bias=False,
    tied_embeddings=False,
    learned_positions=False,
    rms_norm=True,
    make_vocab_size_divisible_by=1,
    experts=Experts(E, K, FE, shared_ffn_hidden_size=FS, shared_gate=True, layer_freq=(0, 1, 1, 1)),
)
ATTENTION = 4 * H * H  # Q, K, V, O (no grouped queries)
NORMS = 2 * H  # RMSNorm: a scale each, two a layer
DENSE_MLP = 3 * H * 128  # gated fc1 (2 x ffn) and fc2
EXPERT = 3 * H * FE
SHARED = 3 * H * FS
ROUTER, GATE = E * H, H


def test_parameters_by_hand() -> None:
    dense_layer = ATTENTION + NORMS + DENSE_MLP
    moe_layer = ATTENTION + NORMS + E * EXPERT + SHARED + ROUTER + GATE
    embeddings = 2 * V * H  # untied: the input table and the output layer
    assert SHAPE.total_parameters() == dense_layer + 3 * moe_layer + embeddings + H
    active_moe = ATTENTION + NORMS + K * EXPERT + SHARED + ROUTER + GATE
    assert SHAPE.active_parameters() == dense_layer + 3 * active_moe + embeddings + H


def test_the_experts_split_over_ep_and_expert_tp() -> None:
    """EP 4 x expert TP 2 on 8 GPUs (TP 2): each GPU holds 2 of each MoE layer's 8 experts,
    each expert's fc1 (2 x 32 columns) and fc2 (32 rows) halved; the dense part halved by TP
    but the router, the gate and the norms whole."""
    layout = Layout(num_nodes=1, gpus_per_node=8, tensor=2, expert=4, expert_tensor=2)
    experts = stage_expert_parameters(SHAPE, layout, "only")
    assert experts == 3 * 2 * EXPERT // 2
    dense_layer = (ATTENTION + DENSE_MLP) // 2 + NORMS
    moe_dense = (ATTENTION + SHARED) // 2 + NORMS + ROUTER + GATE
    embeddings = 2 * V * H // 2
    assert stage_parameters(SHAPE, layout, "only") == (
        dense_layer + 3 * moe_dense + experts + embeddings + H
    )


def test_the_experts_optimizer_is_sharded_over_the_expert_data_parallel_group() -> None:
    """16 GPUs, EP 4: dense parameters' optimizer over 16 data-parallel ranks, the experts'
    over 16 / 4 = 4 (memory.py's module docstring)."""
    layout = Layout(num_nodes=2, gpus_per_node=8, expert=4, precision="bf16")
    memory = memory_breakdown(SHAPE, layout)
    experts = stage_expert_parameters(SHAPE, layout, "only")
    dense = stage_parameters(SHAPE, layout, "only") - experts
    dense_bytes = bytes_per_parameter("bf16", True, 16)
    expert_bytes = bytes_per_parameter("bf16", True, 4)
    assert memory.optimizer == pytest.approx(
        dense * dense_bytes.optimizer + experts * expert_bytes.optimizer
    )
    assert memory.weights == 2 * (dense + experts)


def test_a_moe_layers_activations_by_hand() -> None:
    """memory.py's table, 2-byte elements, TP 2 with sequence parallelism, expert TP 2, b = 2:
    the dense MLP's fc1 output and fc2 input replaced by the routed copies' (k of them), the
    shared expert's, the permuted tokens (x et / t) and the router's fp32 logits and probs."""
    layout = Layout(num_nodes=1, gpus_per_node=2, tensor=2, sequence_parallel=True, micro_batch=2)
    b, t, e = 2, 2, 2
    dense = layer_activation_bytes(SHAPE, layout, moe=False)
    moe = layer_activation_bytes(SHAPE, layout, moe=True)
    dense_mlp = e * S * b * (2 * 128 + 128) / t
    routed = e * S * b * K * (2 * FE + FE) / t
    shared = e * S * b * (2 * FS + FS) / t
    permuted = e * S * b * K * H * 2 / t  # et = 2
    router = 8 * S * b * E / t
    assert moe - dense == pytest.approx(routed + shared + permuted + router - dense_mlp)
    assert dispatch_bytes(SHAPE, layout) == pytest.approx(2 * e * K * S * b * H * 2 / t)


def test_a_capacity_factor_pads_every_expert_to_it() -> None:
    """With capacity factor 1.5 each expert computes 1.5 x its even share, padded: the routed
    activations grow 1.5 times; model FLOPs do not (they count active parameters)."""
    padded = replace(SHAPE, experts=replace(SHAPE.experts, capacity_factor=1.5))
    layout = Layout(num_nodes=1, gpus_per_node=1, micro_batch=1)
    e = 2
    grown = layer_activation_bytes(padded, layout, True) - layer_activation_bytes(
        SHAPE, layout, True
    )
    assert grown == pytest.approx(0.5 * e * S * K * (3 * FE + H))
    assert model_flops_per_sample(padded, V) == model_flops_per_sample(SHAPE, V)


def test_model_flops_count_the_active_parameters() -> None:
    """Per token, 2 FLOPs for each matmul weight it passes forward (the k routed experts,
    the shared one, the router; the shared expert's h x 1 gate left out as the norms are),
    the attention scores and the logits; times 3 for the backward."""
    matmuls = {
        "dense": ATTENTION + DENSE_MLP,
        "moe": ATTENTION + K * EXPERT + SHARED + ROUTER,
    }
    per_token = matmuls["dense"] + 3 * matmuls["moe"]
    scores = 4 * S * S * H * 4  # 4 layers of QK^T and PV: 2 x 2 s^2 q
    logits = 2 * S * H * V
    assert model_flops_per_sample(SHAPE, V) == pytest.approx(
        3 * (2 * S * per_token + scores + logits)
    )


def test_the_all_to_all_by_hand() -> None:
    """EP 8 within a node, expert TP 1, 4 micro-batches of 2 x 16 tokens: per MoE layer and
    micro-batch 4 all-to-alls, each of k s b h e bytes a rank, 7/8 of them moving at NVLink's
    450 GB/s, with 7 latencies of 10 us."""
    layout = Layout(num_nodes=1, gpus_per_node=8, expert=8, micro_batch=2, global_batch=8)
    assert layout.micro_batches == 1
    layout = replace(layout, global_batch=64)
    assert layout.micro_batches == 4
    cluster = ClusterSpec()
    volume = K * S * 2 * H * 2
    one = 7 * 10e-6 + 7 / 8 * volume / 450e9
    assert expert_dispatch_seconds(SHAPE, layout, cluster, "only") == pytest.approx(4 * 3 * 4 * one)
    prediction = predict_step(SHAPE, layout, cluster)
    assert prediction.ep_comm_s == pytest.approx(4 * 3 * 4 * one)


PUBLISHED = [
    # recipe, vocabulary (None: the recipe's), total and active parameters (billions), digits
    ("mixtral/8x7b", None, 46.7, 12.9, 0.05),
    ("mixtral/8x22b", None, 141, 39, 0.5),
    ("qwen2_moe/57b_a14b", None, 57.4, 14.2, 0.05),
    ("qwen3_moe/30b_a3b", None, 30.5, 3.3, 0.06),
    ("deepseek_moe/16b", 102400, 16.4, 2.8, 0.05),
]


@pytest.mark.parametrize(("recipe", "vocab", "total", "active", "within"), PUBLISHED)
def test_the_published_moe_recipes_plan_the_published_parameter_counts(
    recipe: str, vocab: int | None, total: float, active: float, within: float
) -> None:
    """Mixtral's model card (46.7B, 12.9B active; 141B, 39B), Qwen2-57B-A14B's (57.4B, 14.2B),
    Qwen3-30B-A3B's (30.5B, 3.3B) and DeepSeekMoE 16B's paper (16.4B, 2.8B active)."""
    cfg = compose_config([f"training={recipe}"]).training
    family = family_of(cfg, "training")
    rows = vocab or int(cfg.model.padded_vocab_size)
    shape = family.shape(cfg.model, rows, "training")
    assert abs(shape.total_parameters() / 1e9 - total) < within
    assert abs(shape.active_parameters() / 1e9 - active) < within


def test_continued_pretraining_checks_every_expert_architecture_key() -> None:
    assert set(EXPERT_ARCHITECTURE_KEYS) <= set(ARCHITECTURE_DEFAULTS)


# ----- the AutoConfigurator ------------------------------------------------------------------


def test_the_layout_search_takes_ep_for_experts_by_its_rules() -> None:
    from auto_configurator.candidates import RULES, Candidate
    from auto_configurator.searched_models import StackModel

    assert StackModel(SHAPE).auto_expert(16) == (1, 2, 4, 8)
    assert StackModel(SHAPE).auto_expert(4) == (1, 2, 4)
    assert StackModel(replace(SHAPE, experts=None)).auto_expert(16) == (0,)
    rule = {r.name: r for r in RULES}
    base = Layout(num_nodes=1, gpus_per_node=12, global_batch=12)
    assert not rule["experts % EP"].holds(SHAPE, replace(base, expert=3), None)
    assert not rule["GPUs % (EP x PP)"].holds(SHAPE, replace(base, expert=8), None)
    assert not rule["MoE under TP needs SP"].holds(SHAPE, replace(base, tensor=2), None)
    candidate = Candidate(2, 1, None, 1, True, 1, None, 4)
    assert candidate.layout(base).expert == 4 and candidate.layout(base).expert_tensor == 1
    assert "training.model.expert_model_parallel_size=4" in candidate.overrides()
    assert "EP4" in candidate.label
    dense = Candidate(2, 1, None, 1, True, 1, None, 0)
    assert not any("expert" in o for o in dense.overrides()) and "EP" not in dense.label


def test_the_autoconfigurator_base_config_for_mixtral_chooses_its_ep(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from omegaconf import OmegaConf

    from auto_configurator.main import main as autoconfig_main
    from tests.support.autoconfig import validate_training

    code = autoconfig_main(["search_config=gpt3/mixtral_8x7b", f"base_results_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 0, out
    (base,) = tmp_path.rglob("base_cfg_*.yaml")
    validate_training(base, "cluster_type=bcm", "dry_run=true", f"data_dir={tmp_path}")
    recipe = OmegaConf.load(base)
    assert recipe.model.num_moe_experts == 8 and recipe.model.num_layers == 32  # kept
    assert recipe.model.expert_model_parallel_size > 1, recipe.model
    assert "12.9B active parameters" in out
