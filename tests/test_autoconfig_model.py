"""The AutoConfigurator's analytical model (costmodel.shapes, .memory, .throughput, and the
encoder-decoder terms of .estimates) and the `estimate` command, against figures derived here by
hand from the published formulas: Korthikanti et al. 2022 (activations), Megatron-Core's
distributed-optimizer table (bytes per parameter) and Narayanan et al. 2021 (model FLOPs)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from auto_configurator import estimate
from launcher_scripts.costmodel import estimates
from launcher_scripts.costmodel.memory import (
    GIB,
    bytes_per_parameter,
    chunks_in_flight,
    layer_activation_bytes,
    memory_breakdown,
    stage_activations,
)
from launcher_scripts.costmodel.throughput import (
    ClusterSpec,
    hardware_flops_per_step,
    layer_forward_flops,
    model_flops_per_step,
    predict_step,
)
from launcher_scripts.errors import ConfigError
from launcher_scripts.recipes.layout import Layout, read_layout
from launcher_scripts.recipes.model_shape import ModelShape, read_shape
from tests.support.autoconfig import run_autoconfig

REPO = Path(__file__).resolve().parents[1]

# A small GPT: 4 layers, h 256, 8 heads, FFN 4h, sequence 512, vocabulary 1000 (padded to 1024).
SMALL = ModelShape(
    num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8,
    seq_length=512, vocab_size=1000,
)  # fmt: skip
SMALL_LAYER = 12 * 256 * 256 + 13 * 256  # QKV, projection, fc1, fc2 with biases; 2 LayerNorms
SMALL_TOTAL = 1024 * 256 + 512 * 256 + 4 * SMALL_LAYER + 2 * 256  # words, positions, final norm


def one_gpu(**changes: object) -> Layout:
    return replace(Layout(num_nodes=1, gpus_per_node=1), **changes)  # type: ignore[arg-type]


# ----- bytes per parameter: Megatron-Core's distributed optimizer table ---------------------


@pytest.mark.parametrize("d", [1, 2, 8, 64, 1000])
def test_the_distributed_optimizer_table_rows(d: int) -> None:
    rows = {  # (dtype, fp32 grads): (non-distributed, distributed)
        ("fp16", False): (20, 4 + 16 / d),
        ("bf16", True): (18, 6 + 12 / d),
        ("fp32", True): (16, 8 + 8 / d),
    }
    for (dtype, fp32_grads), (plain, sharded) in rows.items():
        assert bytes_per_parameter(dtype, False, d, fp32_grads).total == plain
        assert bytes_per_parameter(dtype, True, d, fp32_grads).total == pytest.approx(sharded)
    # Weights and gradients stay whole on every rank; only the optimizer state is sharded.
    bf16 = bytes_per_parameter("bf16", True, d)
    assert (bf16.weights, bf16.gradients, bf16.optimizer) == (2, 4, pytest.approx(12 / d))


# ----- Korthikanti et al. Table 2, per layer ------------------------------------------------


def test_table_2_per_layer_for_every_row() -> None:
    shape = ModelShape(
        num_layers=96, hidden_size=12288, ffn_hidden_size=4 * 12288, num_attention_heads=96,
        seq_length=2048, vocab_size=51200,
    )  # fmt: skip
    s, b, h, a, t = 2048, 2, 12288, 96, 8
    sbh = s * b * h
    base = Layout(num_nodes=1, gpus_per_node=8, micro_batch=b)
    tp = replace(base, tensor=t)
    sp = replace(tp, sequence_parallel=True)
    rows = [
        (base, sbh * (34 + 5 * a * s / h)),  # no parallelism
        (tp, sbh * (10 + 24 / t + 5 * a * s / (h * t))),  # tensor parallel
        (sp, sbh / t * (34 + 5 * a * s / h)),  # tensor + sequence parallel
        (replace(tp, recompute="selective"), sbh * (10 + 24 / t)),
        (replace(sp, recompute="selective"), sbh / t * 34),
        (replace(tp, recompute="full"), 2 * sbh),
        (replace(sp, recompute="full"), 2 * sbh / t),
    ]
    for layout, expected in rows:
        assert layer_activation_bytes(shape, layout) == pytest.approx(expected), layout


def test_grouped_queries_and_a_gated_mlp_per_layer() -> None:
    """h 1024, 16 heads of 64 in 4 query groups, SwiGLU FFN 2816 (fc1 5632), RMSNorm, no
    biases, untied embeddings: each term of Table 2's derivation at its real width."""
    shape = ModelShape(
        num_layers=2, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=16,
        seq_length=2048, vocab_size=32000, num_query_groups=4, gated_mlp=True, bias=False,
        tied_embeddings=False, learned_positions=False, rms_norm=True,
    )  # fmt: skip
    s, b, h, a = 2048, 1, 1024, 16
    q, kv, fc1, ffn = 1024, 4 * 64, 5632, 2816
    # Replicated: norm, QKV and fc1 inputs (4 x 2 bytes), two dropout masks (2 x 1 byte).
    replicated = 10 * s * b * h
    # Split by TP: Q and K, V, projection input, activation input, fc2 input (2 bytes each).
    split = 2 * s * b * (q + kv + kv + q + fc1 + ffn)
    scores = 5 * a * s * s * b
    assert layer_activation_bytes(shape, one_gpu()) == replicated + split + scores
    two = Layout(num_nodes=1, gpus_per_node=2, tensor=2)
    assert layer_activation_bytes(shape, two) == replicated + (split + scores) / 2
    # Parameters: QKV h x (q + 2 kv), projection q x h, fc1 h x 5632, fc2 2816 x h, 2 RMSNorms.
    matrices = h * (q + 2 * kv) + q * h + h * fc1 + ffn * h
    assert shape.layer_parameters() == matrices + 2 * h == 11_274_240
    assert shape.layer_parameters(2) == matrices // 2 + 2 * h
    # Untied: input table and output layer, no position table; the final RMSNorm.
    assert shape.total_parameters() == 2 * 32000 * h + 2 * (matrices + 2 * h) + h
    # Forward FLOPs: 2 per multiply-add of the matrices, and 2 x 2 s^2 q for the scores.
    assert layer_forward_flops(shape) == 2 * s * matrices + 4 * s * s * q


# ----- whole breakdowns ---------------------------------------------------------------------


def test_no_parallelism_breakdown_by_hand() -> None:
    layout = one_gpu(micro_batch=2, global_batch=2, distributed_optimizer=False)
    m = memory_breakdown(SMALL, layout)
    assert SMALL_TOTAL == 3_552_768 and m.stage == "only"
    assert m.parameters_per_gpu == SMALL_TOTAL
    # bf16 params, fp32 grads, not distributed: 18 bytes = 2 + 4 + 12.
    assert (m.weights, m.gradients, m.optimizer) == (
        2 * SMALL_TOTAL,
        4 * SMALL_TOTAL,
        12 * SMALL_TOTAL,
    )
    sbh = 512 * 2 * 256
    assert m.layer_activations == 4 * sbh * (34 + 5 * 8 * 512 / 256)  # 4 layers of Table 2
    # Section 4.3 at p = 1: embedding dropout mask sbh + 4sbh(1 + v/h), v = 1024 padded.
    assert m.other_activations == sbh + 4 * sbh * (1 + 1024 / 256)
    assert m.recompute_workspace == 0
    assert m.total == pytest.approx(18 * SMALL_TOTAL + (4 * 114 + 21) * sbh)
    assert m.to_json()["total_gib"] == pytest.approx(m.total / 2**30)


def test_tp_sp_pp_vp_selective_breakdown_by_hand() -> None:
    """8 layers, h 512, 8 heads, s 1024, vocabulary 32000 on 2 nodes x 8 GPUs: TP 2, PP 4,
    VP 2, sequence parallel, selective recompute, MBS 1, GBS 32 (DP 2, 16 micro-batches)."""
    shape = ModelShape(
        num_layers=8, hidden_size=512, ffn_hidden_size=2048, num_attention_heads=8,
        seq_length=1024, vocab_size=32000,
    )  # fmt: skip
    layout = Layout(
        num_nodes=2, gpus_per_node=8, tensor=2, pipeline=4, virtual_pipeline=2,
        sequence_parallel=True, micro_batch=1, global_batch=32, recompute="selective",
    )  # fmt: skip
    h, s, t, p, v = 512, 1024, 2, 4, 2
    assert layout.data == 2 and layout.micro_batches == 16
    sbh_t = s * 1 * h / t
    per_layer = 34 * sbh_t  # Table 2: TP + SP + selective
    # First stage, section 4.2.3: L/p layers x p micro-batches x (1 + (p-1)/(pv)) = 11 layers.
    first = stage_activations(shape, layout, "first")
    assert 8 / p * p * (1 + (p - 1) / (p * v)) == 11 == chunks_in_flight(layout, 0)
    assert first.layers == pytest.approx(11 * per_layer)
    assert first.other == pytest.approx(sbh_t * p * (1 + (p - 1) / (p * v)))  # dropout masks
    # Last stage: (v-1)p + 1 = 5 one-layer chunks in flight, plus the final norm's and output
    # layer's inputs (2sbh/t each) and the fp32 logits 4sbv/t of one micro-batch.
    last = stage_activations(shape, layout, "last")
    assert last.layers == pytest.approx(5 * per_layer)
    assert last.other == pytest.approx(4 * sbh_t + 4 * s * 32000 / t)
    # Parameters per TP rank: a layer keeps half of 12h^2 + 7h and all of its 6h of
    # row-parallel biases and LayerNorms; the word table halves, the position table does not.
    layer = (12 * h * h + 7 * h) // 2 + 6 * h
    words = 32000 * h // 2
    first_params = words + s * h + 2 * layer
    last_params = 2 * layer + 2 * h + words
    per_param = 6 + 12 / 2  # bf16 with fp32 grads, distributed over DP 2
    workspace = 5 * 8 * s * s / t  # one layer's recomputed scores
    first_total = first_params * per_param + first.layers + first.other + workspace
    last_total = last_params * per_param + last.layers + last.other + workspace
    m = memory_breakdown(shape, layout)
    assert last_total > first_total and m.stage == "last"
    assert m.parameters_per_gpu == last_params
    assert m.total == pytest.approx(last_total)
    assert m.recompute_workspace == pytest.approx(workspace)


def test_full_recompute_fp32_without_distributed_optimizer_and_cp_2() -> None:
    """SMALL on 4 GPUs: CP 2 (DP 2), full recompute of every layer, fp32, plain Adam."""
    layout = Layout(
        num_nodes=1, gpus_per_node=4, context=2, micro_batch=1, global_batch=2,
        recompute="full", precision="32", distributed_optimizer=False,
    )  # fmt: skip
    m = memory_breakdown(SMALL, layout)
    local, s, h, a = 256, 512, 256, 8  # each CP rank holds 512 / 2 tokens
    # fp32 weights are the main copy: 4 + 4 + 8 bytes per parameter, all on every rank.
    assert (m.weights, m.gradients, m.optimizer) == (
        4 * SMALL_TOTAL,
        4 * SMALL_TOTAL,
        8 * SMALL_TOTAL,
    )
    # Full recompute keeps each layer's input, 4 bytes per element in fp32.
    assert m.layer_activations == 4 * (4 * local * h)
    # One layer recomputed during its backward: norm/QKV/fc1 inputs (4 x 4 bytes) and masks
    # (2 x 1), Q K V and projection input, fc1 output, fc2 input (4 bytes each), and the
    # scores of the local queries against all keys (4 + 4 + 1 bytes).
    whole_layer = 18 * local * h + 4 * local * (4 * 256 + 1024 + 1024) + 9 * a * local * s
    assert m.recompute_workspace == whole_layer
    assert m.other_activations == local * h + 8 * local * h + 4 * local * 1024


def test_full_recompute_of_a_block_of_layers() -> None:
    kept = layer_activation_bytes(SMALL, one_gpu())
    checkpoint = layer_activation_bytes(SMALL, one_gpu(recompute="full"))
    block = one_gpu(recompute="full", recompute_method="block", recompute_num_layers=1)
    m = memory_breakdown(SMALL, block)
    assert m.layer_activations == checkpoint + 3 * kept and m.recompute_workspace == kept
    none = memory_breakdown(SMALL, replace(block, recompute_num_layers=0))
    assert none.layer_activations == 4 * kept and none.recompute_workspace == 0
    groups = memory_breakdown(
        SMALL, replace(block, recompute_method="uniform", recompute_num_layers=2)
    )
    assert groups.layer_activations == 2 * checkpoint and groups.recompute_workspace == 2 * kept


def test_fewer_micro_batches_than_pipeline_stages() -> None:
    """1F1B keeps min(p, m) micro-batches in flight on the first stage."""
    layout = Layout(num_nodes=1, gpus_per_node=4, pipeline=4, micro_batch=1, global_batch=2)
    assert layout.micro_batches == 2
    per_layer = layer_activation_bytes(SMALL, layout)
    assert chunks_in_flight(layout, 0) == 2
    assert stage_activations(SMALL, layout, "first").layers == 1 * 2 * per_layer
    enough = replace(layout, global_batch=8)
    assert stage_activations(SMALL, enough, "first").layers == 1 * 4 * per_layer
    # Interleaved with m = 1: one micro-batch through both chunks, not the paper's factor.
    interleaved = replace(layout, pipeline=2, gpus_per_node=2, virtual_pipeline=2, global_batch=1)
    assert chunks_in_flight(interleaved, 0) == 2  # m x v
    assert stage_activations(SMALL, interleaved, "first").layers == 2 * per_layer


# ----- FLOPs ---------------------------------------------------------------------------------


def test_model_flops_are_narayanans_formula_for_gpt3() -> None:
    shape = ModelShape(
        num_layers=96, hidden_size=12288, ffn_hidden_size=4 * 12288, num_attention_heads=96,
        seq_length=2048, vocab_size=50257,
    )  # fmt: skip
    layout = Layout(num_nodes=128, gpus_per_node=8, tensor=8, pipeline=16, global_batch=1536)
    big_b, s, big_l, h, v = 1536, 2048, 96, 12288, 51200  # V padded to 128 x TP 8
    expected = 72 * big_b * s * big_l * h * h * (1 + s / (6 * h) + v / (12 * big_l * h))
    assert model_flops_per_step(shape, layout) == pytest.approx(expected, rel=1e-12)
    # Recomputation changes the hardware FLOPs, never the model FLOPs.
    full = replace(layout, recompute="full")
    assert model_flops_per_step(shape, full) == model_flops_per_step(shape, layout)
    forward = 24 * s * h * h + 4 * s * s * h  # one layer's forward, one sequence
    assert hardware_flops_per_step(shape, full) == pytest.approx(
        expected + big_b * big_l * forward, rel=1e-12
    )
    # ... which is Narayanan et al.'s count with full recomputation.
    with_recompute = 96 * big_b * s * big_l * h * h * (1 + s / (6 * h) + v / (16 * big_l * h))
    assert hardware_flops_per_step(shape, full) == pytest.approx(with_recompute, rel=1e-12)
    selective = replace(layout, recompute="selective")
    assert hardware_flops_per_step(shape, selective) == pytest.approx(
        expected + big_b * big_l * 4 * s * s * h, rel=1e-12
    )


def test_the_training_logs_and_the_plan_use_the_same_flops() -> None:
    model = {
        "num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 1024,
        "num_attention_heads": 8, "encoder_seq_length": 512,
    }  # fmt: skip
    layout = one_gpu(global_batch=1)
    assert estimates.model_flops_per_sample(model, 512, 1024) == model_flops_per_step(SMALL, layout)


# ----- step time ----------------------------------------------------------------------------

GPT_5B = ModelShape(
    num_layers=24, hidden_size=4096, ffn_hidden_size=16384, num_attention_heads=32,
    seq_length=2048, vocab_size=50257,
)  # fmt: skip
H100 = ClusterSpec()


def test_compute_and_tp_time_by_hand() -> None:
    layout = Layout(num_nodes=1, gpus_per_node=8, tensor=8, micro_batch=1, global_batch=4)
    step = predict_step(GPT_5B, layout, H100)
    rate = 989e12 * 0.55
    assert layout.data == 1 and layout.micro_batches == 4
    assert step.compute_s == pytest.approx(model_flops_per_step(GPT_5B, layout) / 8 / rate)
    # 4 all-reduces a layer and micro-batch of s*b*h bf16 values, ring 2 (t-1)/t, NVLink;
    # each all-reduce is 2 x (t-1) ring steps of 10 us latency.
    volume = 2 * 2048 * 4096
    per_all_reduce = 2 * 7 / 8 * volume / 450e9 + 2 * 7 * 10e-6
    assert step.tp_comm_s == pytest.approx(4 * 24 * 4 * per_all_reduce)
    assert step.pp_bubble_s == 0 and step.dp_comm_s == 0 and step.cp_comm_s == 0
    assert step.step_time_s == pytest.approx(step.compute_s + step.tp_comm_s)
    world = 8
    expected_tflops = step.model_flops_per_step / step.step_time_s / world / 1e12
    assert step.tflops_per_gpu == pytest.approx(expected_tflops)


def test_tp_across_nodes_costs_more_than_within_one() -> None:
    inside = Layout(num_nodes=2, gpus_per_node=8, tensor=8, global_batch=16)
    across = replace(inside, gpus_per_node=4, num_nodes=4)  # TP 8 spans two 4-GPU nodes
    wider = replace(inside, tensor=16)  # TP 16 spans both 8-GPU nodes
    t_inside = predict_step(GPT_5B, inside, H100).tp_comm_s
    assert predict_step(GPT_5B, across, H100).tp_comm_s > t_inside
    assert predict_step(GPT_5B, wider, H100).tp_comm_s > t_inside


def test_more_micro_batches_shrink_the_bubble() -> None:
    layout = Layout(num_nodes=1, gpus_per_node=8, pipeline=8, micro_batch=4, global_batch=32)
    bubbles = [
        predict_step(GPT_5B, replace(layout, micro_batch=mbs), H100).pp_bubble_s
        for mbs in (4, 2, 1)  # 8, 16, 32 micro-batches of the same global batch
    ]
    assert bubbles[0] > bubbles[1] > bubbles[2] > 0
    fractions = [
        (step.pp_bubble_s / step.compute_s)
        for step in (
            predict_step(GPT_5B, replace(layout, global_batch=gbs), H100) for gbs in (32, 64)
        )
    ]
    assert fractions[0] == pytest.approx(7 / 8) and fractions[1] < fractions[0]
    interleaved = replace(layout, pipeline=4, gpus_per_node=4, virtual_pipeline=2)
    plain = replace(interleaved, virtual_pipeline=None)
    assert (
        predict_step(GPT_5B, interleaved, H100).pp_bubble_s
        < predict_step(GPT_5B, plain, H100).pp_bubble_s
    )


def test_fixed_per_layer_cost_and_pipeline_sends_by_hand() -> None:
    layout = Layout(num_nodes=1, gpus_per_node=8, pipeline=2, micro_batch=1, global_batch=8)
    assert layout.data == 4 and layout.micro_batches == 2
    step = predict_step(GPT_5B, layout, replace(H100, layer_overhead_us=100.0))
    plain = predict_step(GPT_5B, layout, H100)
    # 2 micro-batches x the stage's 12 layers x 100 us.
    assert step.overhead_s == pytest.approx(2 * 12 * 100e-6)
    assert plain.overhead_s == 0 and step.compute_s == plain.compute_s
    # The bubble is (p - 1) / m of everything the stage does per step.
    assert step.pp_bubble_s == pytest.approx(1 / 2 * (step.compute_s + step.overhead_s))
    # Per micro-batch one send forward and one back of s*b*h bf16 values, 10 us each, NVLink.
    send = 10e-6 + 2 * 2048 * 4096 / 450e9
    assert step.pp_comm_s == pytest.approx(2 * 2 * send)
    interleaved = predict_step(GPT_5B, replace(layout, virtual_pipeline=2), H100)
    assert interleaved.pp_comm_s == pytest.approx(2 * 2 * 2 * send)  # a pair per model chunk
    assert step.step_time_s == pytest.approx(
        step.compute_s + step.overhead_s + step.pp_bubble_s + step.pp_comm_s + step.dp_exposed_s
    )


def test_tp_splits_the_flops_but_not_the_fixed_cost() -> None:
    """On a small model the fixed cost decides: TP 2 runs every micro-batch through every
    layer on both processes, data parallelism half of them on each."""
    tiny = ModelShape(
        num_layers=4, hidden_size=128, ffn_hidden_size=512, num_attention_heads=4,
        seq_length=128, vocab_size=8000,
    )  # fmt: skip
    cpu = replace(H100, peak_tflops=0.2, compute_efficiency=1.0, layer_overhead_us=3000.0)
    data_parallel = Layout(num_nodes=1, gpus_per_node=2, micro_batch=4, global_batch=8)
    tensor_parallel = replace(data_parallel, tensor=2)
    dp_step = predict_step(tiny, data_parallel, cpu)
    tp_step = predict_step(tiny, tensor_parallel, cpu)
    assert tp_step.compute_s == pytest.approx(dp_step.compute_s, rel=0.02)  # vocab padding
    assert tp_step.overhead_s == pytest.approx(2 * dp_step.overhead_s)
    assert tp_step.step_time_s > dp_step.step_time_s


def test_data_parallel_reduction_and_its_overlap() -> None:
    inside = Layout(num_nodes=1, gpus_per_node=8, global_batch=8)
    across = replace(inside, num_nodes=2, global_batch=16)
    step = predict_step(GPT_5B, inside, H100)
    params = memory_breakdown(GPT_5B, inside).parameters_per_gpu
    # Distributed optimizer: reduce-scatter fp32 gradients, all-gather bf16 weights, 7/8 each.
    assert step.dp_comm_s == pytest.approx(7 / 8 * params * (4 + 2) / 450e9 + 2 * 7 * 10e-6)
    assert step.dp_exposed_s == pytest.approx(0.5 * step.dp_comm_s)
    plain = predict_step(GPT_5B, replace(inside, distributed_optimizer=False), H100)
    all_reduce = 2 * (7 / 8 * params * 4 / 450e9 + 7 * 10e-6)
    assert plain.dp_comm_s == pytest.approx(all_reduce)
    assert predict_step(GPT_5B, across, H100).dp_comm_s > step.dp_comm_s
    hidden = predict_step(GPT_5B, inside, replace(H100, dp_overlap=1.0))
    assert hidden.dp_exposed_s == 0 and hidden.step_time_s < step.step_time_s


def test_context_parallel_exchanges_keys_and_values() -> None:
    layout = Layout(num_nodes=1, gpus_per_node=8, context=2, global_batch=4)
    step = predict_step(GPT_5B, layout, H100)
    # Per layer and micro-batch: 3 x (cp - 1) hops of K and V for 1024 local tokens.
    kv = 2 * 2 * 1024 * 4096
    hop = 10e-6 + kv / 450e9
    assert step.cp_comm_s == pytest.approx(layout.micro_batches * 24 * 3 * hop)
    assert predict_step(GPT_5B, replace(layout, context=1), H100).cp_comm_s == 0


def test_cluster_settings_are_checked() -> None:
    spec = ClusterSpec.from_settings({"peak_tflops": 312, "inter_node_gbps": 25.0})
    assert spec.peak_tflops == 312 and spec.gpus_per_node == 8
    for settings, message in [
        ({"peak": 1}, "cluster.peak: is not a cluster setting"),
        ({"peak_tflops": "fast"}, "cluster.peak_tflops: 'fast' is not a number"),
        ({"compute_efficiency": 1.5}, "cluster.compute_efficiency: 1.5 is above 1"),
        ({"gpus_per_node": 4.5}, "cluster.gpus_per_node: 4.5 is not an integer"),
    ]:
        with pytest.raises(ConfigError) as error:
            ClusterSpec.from_settings(settings)
        assert str(error.value).startswith(message)


# ----- recipes ------------------------------------------------------------------------------


def test_shape_and_layout_from_a_recipe() -> None:
    from launcher_scripts.config.compose import compose_config

    cfg = compose_config(["training=gpt3/1b_improved"]).training
    shape = read_shape(cfg.model, vocab_size=50257)
    layout = read_layout(cfg, "")
    assert shape.gated_mlp and not shape.tied_embeddings and not shape.learned_positions
    assert shape.ffn_hidden_size == int(cfg.model.ffn_hidden_size)
    assert layout.recompute == "selective" and not layout.distributed_optimizer
    assert layout.world_size == int(cfg.trainer.num_nodes) * int(cfg.trainer.devices)


# ----- the estimate command -------------------------------------------------------------------

GPT3_KEYS = [
    "model.num_layers=24",
    "model.hidden_size=4096",
    "model.num_attention_heads=32",
    "model.encoder_seq_length=2048",
    "trainer.num_nodes=2",
    "model.tensor_model_parallel_size=2",
    "model.pipeline_model_parallel_size=2",
    "model.micro_batch_size=2",
    "model.global_batch_size=64",
    "model.activations_checkpoint_granularity=selective",
    "model.sequence_parallel=true",
]
REQUIRED_JSON = {
    "parameters_per_gpu",
    "weights_gib",
    "gradients_gib",
    "optimizer_gib",
    "layer_activations_gib",
    "other_activations_gib",
    "total_gib",
    "model_flops_per_step",
}


def run_estimate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "auto_configurator.estimate", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )


def test_estimate_prints_an_aligned_table() -> None:
    result = run_estimate(*GPT3_KEYS, "cluster=h100")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    shape = replace(GPT_5B, vocab_size=50257)
    layout = Layout(
        num_nodes=2, gpus_per_node=8, tensor=2, pipeline=2, sequence_parallel=True,
        micro_batch=2, global_batch=64, recompute="selective",
    )  # fmt: skip
    m = memory_breakdown(shape, layout)
    rows = {line.split("  ")[1].strip(): line for line in lines if line.startswith("  ")}
    for name, gib in [
        ("weights", m.weights_gib),
        ("gradients", m.gradients_gib),
        ("optimizer", m.optimizer_gib),
        ("layer activations", m.layer_activations_gib),
        ("other activations", m.other_activations_gib),
        ("total", m.total_gib),
    ]:
        assert f"{gib:.3f}" in rows[name], name
    step = predict_step(shape, layout, H100)
    assert f"{step.step_time_s:.4f}" in rows["step time"]
    assert "of 80 GiB: fits" in rows["total"]
    # The names are padded to one width, so every value starts in the same column.
    width = max(len(name) for name in rows)
    for name, line in rows.items():
        assert line[2 : 2 + width].rstrip() == name and line[2 + width : 4 + width] == "  "
        assert line[4 + width] != " " or line[4 + width :].strip()[0].isdigit()


def test_estimate_json_has_the_issue_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert estimate.main([*GPT3_KEYS, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain.keys() >= REQUIRED_JSON and "predicted_step_time_s" not in plain
    assert estimate.main([*GPT3_KEYS, "--json", "cluster.peak_tflops=312"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described.keys() >= REQUIRED_JSON | {"predicted_step_time_s"}
    slower = json.loads(run_estimate(*GPT3_KEYS, "--json", "cluster=h100").stdout)
    assert described["predicted_step_time_s"] > slower["predicted_step_time_s"] > 0
    assert described["total_gib"] * GIB == pytest.approx(
        sum(
            described[key] * GIB
            for key in (
                "weights_gib",
                "gradients_gib",
                "optimizer_gib",
                "layer_activations_gib",
                "other_activations_gib",
                "recompute_workspace_gib",
            )
        )
    )


def test_estimate_reads_a_recipe_and_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    assert estimate.main(["training=gpt3/126m", "trainer.num_nodes=1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["parameters_total"] == 125_262_336  # tests/test_plan.py's hand count
    assert result["layout"]["data"] == 8 and result["layout"]["micro_batch"] == 4
    assert result["vocab_assumed"] and result["model"]["vocab_size"] == 50257
    args = ["training=gpt3/126m", "model.padded_vocab_size=32000", "--json"]
    assert estimate.main([*args, "model.tensor_model_parallel_size=2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["padded_vocab_size"] == 32000 and not result["vocab_assumed"]
    assert result["layout"]["tensor"] == 2 and result["layout"]["data"] == 32


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["model.num_layerz=4"], "error: model.num_layerz: is not a key estimate reads."),
        (GPT3_KEYS[1:], "error: model.num_layers: is missing."),
        (
            [*GPT3_KEYS, "model.num_layers=abc"],
            "error: model.num_layers: 'abc' is not an integer.",
        ),
        (
            [*GPT3_KEYS, "model.tensor_model_parallel_size=3"],
            "error: model.tensor_model_parallel_size: 3 does not divide the 32 attention heads.",
        ),
        (
            [*GPT3_KEYS, "model.global_batch_size=30"],
            "error: model.global_batch_size: 30 is not a multiple of",
        ),
        (["training=gpt3/9b"], "error: training=gpt3/9b: no such recipe."),
        (
            ["training=t5/220m", "model.num_layers=4"],
            "error: model.num_layers: is set per block in an encoder-decoder recipe. Use "
            "model.encoder.num_layers",
        ),
        (
            [*GPT3_KEYS, "model.decoder.num_layers=4"],
            "error: model.decoder.num_layers: is a key of encoder-decoder recipes.",
        ),
        (
            ["training=t5/220m", "trainer.devices=4", "model.pipeline_model_parallel_size=4"],
            "error: training.model.pipeline_model_parallel_split_rank: 2 must be PP - 1 = 3",
        ),
        ([*GPT3_KEYS, "cluster.dp_overlap=2"], "error: cluster.dp_overlap: 2 is above 1."),
        (["num_layers"], "error: num_layers: is not key=value."),
    ],
)
def test_estimate_bad_input_is_one_line(
    args: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert estimate.main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(line) and captured.err.count("\n") == 1, captured.err


def test_estimate_as_a_module_reports_bad_input_with_exit_2() -> None:
    result = run_estimate("model.hidden_size=64")
    assert result.returncode == 2
    assert result.stderr.startswith("error: model.num_attention_heads: is missing.")


# ----- T5: cross-attention and the encoder/decoder pipeline split, by hand --------------------

T5_KEYS = [
    "training=t5/220m", "trainer.num_nodes=1", "trainer.devices=2",
    "model.pipeline_model_parallel_size=2", "model.pipeline_model_parallel_split_rank=1",
    "model.micro_batch_size=4", "model.global_batch_size=32",
    *(
        f"model.{block}.{key}"
        for block in ("encoder", "decoder")
        for key in (
            "hidden_size=1024", "num_attention_heads=16", "kv_channels=64",
            "ffn_hidden_size=4096", "activation=gelu", "activations_checkpoint_granularity=null",
        )
    ),
    "model.encoder.num_layers=4", "model.decoder.num_layers=2",
]  # fmt: skip


def test_t5_estimate_by_hand(capsys: pytest.CaptureFixture[str]) -> None:
    """A 4+2-layer T5 (h 1024, 16 heads, FFN 4h, bf16), encoder on stage 0 and decoder on
    stage 1, MBS 4 of GBS 32 (8 micro-batches, DP 1), encoder 512 and decoder 128 tokens, the
    assumed vocabulary (28996 WordPieces + 100 sentinels) padded to 29184."""
    assert estimate.main([*T5_KEYS, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    h, a, v, enc, dec, b = 1024, 16, 29184, 512, 128, 4
    assert result["padded_vocab_size"] == v and result["vocab_assumed"]

    # Parameters. A layer: QKV 3h^2+3h, projection h^2+h, fc1 4h^2+4h, fc2 4h^2+h, two
    # LayerNorms 4h. Cross-attention: Q, K, V, projection 4h^2 + 4h, its LayerNorm 2h.
    layer = 12 * h * h + 13 * h
    cross = 4 * h * h + 6 * h
    embeddings = v * h + 512 * h  # words, learned positions (512)
    stage_0 = embeddings + 4 * layer + 2 * h  # the encoder and its final norm
    stage_1 = embeddings + 2 * (layer + cross) + 2 * h + v  # final norm, LM-head bias
    assert result["parameters_total"] == stage_0 + stage_1 - embeddings
    assert result["parameters_per_gpu"] == max(stage_0, stage_1) == stage_0
    # bf16 with fp32 gradients and the distributed optimizer over 1 rank: 2 + 4 + 12 bytes.
    weights, gradients, optimizer = 2 * stage_0, 4 * stage_0, 12 * stage_0

    # Activations, Korthikanti et al. Table 2 per layer: sbh(34 + 5as/h) bytes.
    encoder_layer = enc * b * h * (34 + 5 * a * enc / h)
    # Cross-attention, derived as Table 2's attention block: Q and the projection input over
    # the decoder's tokens and K, V over the encoder's (2 bytes each, 4sbh + 4 s_enc bh), the
    # scores' softmax, dropout output and mask (5 a s s_enc b), the norm input, Q-projection
    # input and the dropout mask (5sbh).
    cross_bytes = (4 * dec + 4 * enc) * b * h + 5 * a * dec * enc * b + 5 * dec * b * h
    decoder_layer = dec * b * h * (34 + 5 * a * dec / h) + cross_bytes
    # Stage 0 under 1F1B holds min(PP, m) = 2 micro-batches: its 4 layers, the embedding's
    # dropout mask (sbh) and the encoder's final-norm input (2sbh) each.
    stage_0_layers = 2 * 4 * encoder_layer
    stage_0_other = 2 * (enc * b * h + 2 * enc * b * h)
    # Stage 1 holds one: 2 layers, the decoder embedding's mask, the received encoder output
    # (2 s_enc bh) and [K] 4.3's head: the final norm's and output layer's inputs (4sbh) and
    # fp32 logits (4sbV).
    stage_1_layers = 2 * decoder_layer
    stage_1_other = dec * b * h + 2 * enc * b * h + 4 * dec * b * h + 4 * dec * b * v
    assert stage_0_layers + stage_0_other > stage_1_layers + stage_1_other
    expected = {
        "weights_gib": weights,
        "gradients_gib": gradients,
        "optimizer_gib": optimizer,
        "layer_activations_gib": stage_0_layers,
        "other_activations_gib": stage_0_other,
        "total_gib": weights + gradients + optimizer + stage_0_layers + stage_0_other,
    }
    for key, value in expected.items():
        assert result[key] * GIB == pytest.approx(value, rel=1e-12), key

    # Model FLOPs (x3 for backward), Narayanan et al.'s counting: each layer 24sh^2 + 4s^2h,
    # cross-attention 4h^2 (s + s_enc) for its projections + 4 s s_enc h, the LM head 2shV.
    forward = (
        4 * (24 * enc * h * h + 4 * enc * enc * h)
        + 2 * (24 * dec * h * h + 4 * dec * dec * h)
        + 2 * (4 * h * h * (dec + enc) + 4 * dec * enc * h)
        + 2 * dec * h * v
    )
    assert result["model_flops_per_step"] == pytest.approx(32 * 3 * forward, rel=1e-12)


def test_t5_estimate_table_names_the_split_and_the_step_time() -> None:
    result = run_estimate(*T5_KEYS, "cluster=h100")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "encoder     " in out and "4 layers, hidden 1024, 16 heads, FFN 4096, seq 512" in out
    assert "PP 2 (encoder on stage 0, decoder on stage 1)" in out
    assert "of 80 GiB: fits" in out
    assert "predicted step, seconds" in out and "pipeline bubble" in out


def test_t5_step_time_by_hand(capsys: pytest.CaptureFixture[str]) -> None:
    """T5_KEYS at TP 2 on 4 GPUs (DP 1, 8 micro-batches of 4): the encoder's 4 layers on stage
    0, the decoder's 2 and the LM head on stage 1; costmodel.encoder_decoder's terms, by hand,
    on a cluster of round numbers."""
    cluster = {
        "peak_tflops": 100, "compute_efficiency": 0.5, "intra_node_gbps": 100,
        "collective_latency_us": 10, "layer_overhead_us": 100, "dp_overlap": 0,
    }  # fmt: skip
    keys = [*T5_KEYS, "trainer.devices=4", "model.tensor_model_parallel_size=2"]
    keys += [f"cluster.{name}={value}" for name, value in cluster.items()]
    assert estimate.main([*keys, "--json"]) == 0
    step = json.loads(capsys.readouterr().out)["step"]
    h, v, enc, dec, b, t, m = 1024, 29184, 512, 128, 4, 2, 8
    rate, latency, overhead = 100e12 * 0.5, 10e-6, 100e-6
    # Forward FLOPs of one sequence: a layer 24sh^2 + 4s^2h; cross-attention 4h^2 (s + s_enc)
    # + 4 s s_enc h; the LM head 2shV. Stage time = 3 x forward x b / t at the rate.
    encoder_layer = 24 * enc * h * h + 4 * enc * enc * h
    decoder_layer = 24 * dec * h * h + 4 * dec * dec * h + 4 * h * h * (dec + enc)
    decoder_layer += 4 * dec * enc * h
    stage_0_compute = 4 * 3 * encoder_layer * b / t / rate
    stage_1_compute = (2 * 3 * decoder_layer + 3 * 2 * dec * h * v) * b / t / rate

    def allreduce(tokens: int) -> float:  # a ring over 2 ranks: reduce-scatter + all-gather
        return 2 * (latency + 0.5 * 2 * tokens * b * h / 100e9)

    # An encoder layer: 2 all-reduces forward, 2 backward; a decoder layer 3 + 3 of its own
    # tokens and 1 of the encoder's (the gradient of cross-attention's K/V input).
    stage_0 = stage_0_compute + 4 * overhead + 4 * 4 * allreduce(enc)
    stage_1 = stage_1_compute + 2 * 1.5 * overhead + 2 * (6 * allreduce(dec) + allreduce(enc))
    assert stage_0 > stage_1
    # 1F1B: m x the busiest stage, plus the other stage's fill/drain; the encoder output sent
    # forward and its gradient back per micro-batch.
    sends = m * 2 * (latency + 2 * enc * b * h / 100e9)
    assert step["compute_s"] == pytest.approx(m * stage_0_compute, rel=1e-12)
    assert step["tp_comm_s"] == pytest.approx(m * 4 * 4 * allreduce(enc), rel=1e-12)
    assert step["overhead_s"] == pytest.approx(m * 4 * overhead, rel=1e-12)
    assert step["pp_bubble_s"] == pytest.approx(stage_1, rel=1e-12)
    assert step["pp_comm_s"] == pytest.approx(sends, rel=1e-12)
    assert step["dp_comm_s"] == 0  # DP 1
    assert step["step_time_s"] == pytest.approx(m * stage_0 + stage_1 + sends, rel=1e-12)


@pytest.mark.parametrize(
    ("word", "hint"),
    [("estimat", "did you mean 'estimate'? "), ("recommend", "")],
)
def test_a_word_that_is_no_command_names_the_commands(word: str, hint: str) -> None:
    """Hydra alone says "missing EQUAL" of a word without "=" (a misspelt command)."""
    result = run_autoconfig(word, "training=gpt3/126m")
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: unknown command {word!r}: {hint}the commands are estimate ")
    assert "auto_configurator/main.py estimate [--json] [KEY=VALUE ...]" in line
