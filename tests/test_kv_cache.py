"""The KV caches generation runs on (jobs/inference/kv_cache.py; seq2seq_cache.py for T5), on
the tiny models: every logits row they return equals the model's full pass over the sequence,
through the moves that in-flight batching and beam search make (joins, forks, drops, moving
right, compaction), and generate() through them gives what generate() rerunning whole rows
gives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.commands import module_report


@pytest.fixture(scope="module")
def report(tiny_portable: Path) -> dict[str, Any]:
    return module_report("tests.scripts.kv_cache_check", str(tiny_portable))


def test_cached_logits_are_the_full_pass_through_every_move(report: dict[str, Any]) -> None:
    script = report["script"]
    assert script["max_diff"] < 1e-4, script
    # The script made every move it is meant to check.
    for move in ("moved_right", "compacted", "forked", "dropped", "joined"):
        assert script[move] >= 1, (move, script)


def test_the_cache_refuses_what_it_cannot_hold(report: dict[str, Any]) -> None:
    refused = report["refusals"]
    assert refused["slots"] == "CacheFull: 1 + 1 sequences; 1 slots"
    assert refused["positions"] == "CacheFull: a prompt of 9 tokens; 8 positions"
    assert refused["partial_step"].startswith("ValueError: a step appends a token to every live")
    assert refused["unknown"].startswith("KeyError")


def test_generate_through_the_cache_is_generate_over_whole_rows(report: dict[str, Any]) -> None:
    assert report["engine"] == {"greedy": True, "beam": True, "sampled": True}


def test_a_prompt_tuned_model_generates_through_the_cache_as_over_whole_rows(
    report: dict[str, Any],
) -> None:
    """Virtual tokens take their embeddings by position, so the cache's steps (one token past
    the prompt) keep theirs: a tuned model's evaluation generates as it did rerunning rows."""
    assert report["prompt_tuned"] == {"same": True, "prompt_changed_logits": True}


@pytest.fixture(scope="module", params=[(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def t5_report(request: pytest.FixtureRequest, t5_converted: Path) -> dict[str, Any]:
    model = t5_converted / "t5_tiny" / "convert_nemo" / "megatron_t5.nemo"
    tensor, pipeline = request.param
    layout = (str(tensor), str(pipeline))
    return module_report(
        "tests.scripts.kv_cache_check", str(model), *layout, processes=tensor * pipeline
    )


def test_the_t5_cache_is_the_full_pass_and_generates_as_whole_rows(
    t5_report: dict[str, Any],
) -> None:
    """The encoder once per sequence, the decoder a token a step (with T5's relative position
    bias at the cache's positions, split over the TP ranks' heads at TP=2; at PP=2 the encoder
    on one stage, the decoder and its cache on the other), through the same moves."""
    script = t5_report["script"]
    assert script["max_diff"] < 1e-4, script
    for move in ("moved_right", "compacted", "forked", "dropped", "joined"):
        assert script[move] >= 1, (move, script)
    assert t5_report["engine"] == {"greedy": True, "beam": True, "sampled": True}


def test_the_lean_transformer_layers_are_megatron_core_s(report: dict[str, Any]) -> None:
    """Inference calls a plain layer's norms, attention and MLP, and the MLP's linear layers
    and activation, without megatron-core's training wrappers (lean_layer.py): the same
    logits, whole rows and through the cache."""
    lean = report["lean_layers"]
    assert lean["layers"] >= 2 and lean["mlps"] == lean["layers"], lean
    assert lean["max_diff"] < 1e-6, lean


def test_t5_s_encoder_layers_are_lean_and_megatron_core_s(t5_report: dict[str, Any]) -> None:
    """T5's encoder layers take the lean forward; its decoder's have cross-attention and keep
    megatron-core's. The same logits either way."""
    lean = t5_report["lean_layers"]
    assert lean["layers"] >= 1, lean
    assert lean["max_diff"] < 1e-6, lean


def test_the_fused_local_attention_is_megatron_core_s() -> None:
    """What decoding runs in place of megatron-core's local attention gives its outputs, with
    grouped and plain heads, over a causal square, a cache step and left padding."""
    report = module_report("tests.scripts.fused_attention_check")
    for layout, cases in report.items():
        for case, difference in cases.items():
            assert difference < 1e-5, (layout, case, difference)
