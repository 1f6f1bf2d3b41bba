"""The README's first success: `python3 main.py` on a fresh machine trains, converts, evaluates
and exports the tiny model, and leaves the artifacts the README promises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.training import losses


def test_default_pipeline_trains_and_leaves_its_artifacts(default_run: Path) -> None:
    """`python3 main.py` as on a fresh machine, shortened (conftest's default_run)."""
    log_dir = default_run / "results" / "gpt3_tiny" / "results"
    curve = losses(log_dir)
    assert curve[30] < curve[1] - 1.0, curve  # it learns, clearly
    assert (log_dir / "loss_curve.png").stat().st_size > 0
    assert (log_dir / "hparams.yaml").is_file()
    assert list((log_dir / "tensorboard").glob("events.out.tfevents.*"))
    checkpoints = sorted(p.name for p in (log_dir / "checkpoints").iterdir())
    assert any("step=30" in name for name in checkpoints), checkpoints
    assert all((log_dir / "checkpoints" / n / "train_state.json").is_file() for n in checkpoints)
    record = json.loads((log_dir / "metrics.jsonl").read_text().splitlines()[0])
    for name in ("lr", "grad_norm", "train_step_timing", "tokens_per_sec", "peak_memory_gb"):
        assert name in record
    assert record["model_tflops_per_gpu"] > 0
    converted = default_run / "results" / "gpt3_tiny" / "convert_nemo"
    assert (converted / "megatron_gpt.nemo").stat().st_size > 0
    assert (converted / "hf" / "model.safetensors").is_file()
    evaluated = default_run / "results" / "gpt3_tiny" / "eval_all"
    results = json.loads((evaluated / "results.json").read_text())["results"]
    assert {"tiny_lambada", "tiny_choice", "tiny_wikitext", "tiny_generate"} <= set(results)
    assert "| tiny_choice | acc |" in (evaluated / "results.md").read_text()
    exported = default_run / "results" / "gpt3_tiny" / "export"
    assert (exported / "model_repo" / "gpt3_tiny" / "config.pbtxt").is_file()
    check = json.loads((exported / "check.json").read_text())
    assert check["text"] and "\u2047" not in check["text"]  # the tokenizer covers the corpus
    # NeMo's lambada check of the export measures what the evaluation stage's lm-eval does.
    lambada = check["lambada"]
    assert lambada["examples"] == results["tiny_lambada"]["sample_len"]
    assert lambada["acc"] == pytest.approx(results["tiny_lambada"]["acc,none"])
    assert not [name for name in checkpoints if "nan" in name], checkpoints
