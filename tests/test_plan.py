"""The dry-run plan's estimates against values computed by hand for two layouts of the 126m
recipe, the fit check, and the plan table."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher_scripts.config.compose import compose_config
from launcher_scripts.costmodel.plan import check_fits
from launcher_scripts.errors import ConfigError
from launcher_scripts.families import family_of
from tests.support.commands import run_main
from tests.support.dry_runs import without_slurm

# GPT-3 126m: h 768, 12 layers, 12 heads, FFN 3072, sequence 2048, learned positions, GeLU,
# LayerNorm, biases, tied embeddings; the GPT-2 vocabulary 50257 padded to 50304 (128).
LAYER = (768 * 2304 + 2304) + (768 * 768 + 768) + (2 * 768 * 3072 + 3072 + 768) + 2 * 2 * 768
WORDS, POSITIONS, FINAL_NORM = 50304 * 768, 2048 * 768, 2 * 768
TOTAL = WORDS + POSITIONS + 12 * LAYER + FINAL_NORM


def plan_of(tmp_path: Path, *overrides: str, recipe: str = "126m"):  # type: ignore[no-untyped-def]
    # No data or tokenizer files: the vocabulary is then GPT-2's, as assumed here.
    cfg = compose_config(
        [
            f"training=gpt3/{recipe}",
            "cluster_type=bcm",
            f"data_dir={tmp_path}",
            f"base_results_dir={tmp_path}",
            *overrides,
        ]
    )
    return family_of(cfg.training, "training").plan(cfg, "training")


def test_126m_as_published(tmp_path: Path) -> None:
    plan = plan_of(tmp_path)
    assert LAYER == 7_087_872 and TOTAL == 125_262_336
    assert plan.vocab == 50257 and plan.vocab_assumed
    assert plan.params.total == TOTAL == plan.params.per_gpu
    assert plan.layout.data == 64 and plan.micro_batches == 1  # 8 nodes x 8 GPUs, GBS 256 / MBS 4
    assert plan.memory.stage == "only"
    assert plan.memory.weights == 2 * TOTAL  # bf16
    assert plan.memory.gradients == 4 * TOTAL  # fp32 gradient buffer
    assert plan.memory.optimizer == 12 * TOTAL / 64  # distributed optimizer over DP 64
    # Korthikanti et al. Table 2, no parallelism: s*b*h*(34 + 5*a*s/h) per layer, 12 layers.
    sbh = 2048 * 4 * 768
    assert plan.memory.layer_activations == pytest.approx(sbh * (34 + 5 * 12 * 2048 / 768) * 12)
    # Section 4.3 at t = 1, p = 1: the embedding dropout mask sbh, and 4sbh(1 + v/h) for the
    # final norm's input, the output layer's input and the fp32 logits (v padded: 50304).
    assert plan.memory.other_activations == pytest.approx(sbh + 4 * sbh * (1 + 50304 / 768))
    assert plan.memory.recompute_workspace == 0  # no recomputation


def test_126m_at_tp2_pp2_with_sequence_parallelism_and_selective_recompute(
    tmp_path: Path,
) -> None:
    plan = plan_of(
        tmp_path,
        "training.trainer.num_nodes=1",
        "training.model.tensor_model_parallel_size=2",
        "training.model.pipeline_model_parallel_size=2",
        "training.model.sequence_parallel=true",
        "training.model.activations_checkpoint_granularity=selective",
    )
    h = 768
    # On one TP rank a layer holds half of its matrices and of the QKV and fc1 biases
    # (12h^2 + 7h), and all of the row-parallel biases and both LayerNorms (2h + 4h).
    layer_rank = (12 * h * h + 7 * h) // 2 + 6 * h
    assert (12 * h * h + 7 * h) + 6 * h == LAYER
    # At TP 2 the vocabulary pads to a multiple of 128 x 2: 50432 rows, half on each rank. The
    # first stage also holds the (whole, not vocabulary-parallel) position table; the last
    # the final norm and its copy of the word embeddings.
    words_rank = 50432 * h // 2
    first_params = words_rank + POSITIONS + 6 * layer_rank
    last_params = 6 * layer_rank + FINAL_NORM + words_rank
    assert plan.layout.data == 2 and plan.micro_batches == 32
    # Activations, s*b*h/t * 34 per layer (Table 2, TP + SP + selective), sbh/t = 3,145,728:
    # the first stage holds its 6 layers for 2 micro-batches in flight and their embedding
    # dropout masks (sbh/t each); the last stage 6 layers for 1 micro-batch, plus the final
    # norm's and output layer's inputs (2sbh/t each) and the fp32 logits 4*s*b*v/t.
    sbh_t = 2048 * 4 * h / 2
    first_activations = 6 * 2 * 34 * sbh_t + 2 * sbh_t
    last_activations = 6 * 34 * sbh_t + 4 * sbh_t + 4 * 2048 * 4 * 50432 / 2
    # 12 bytes per parameter: 2 + 4 + 12 / DP 2. The last stage is the more loaded:
    # 40.7M params (489 MB) + 1.48 GB against 42.3M params (507 MB) + 1.29 GB.
    assert 12 * last_params + last_activations > 12 * first_params + first_activations
    assert plan.memory.stage == "last"
    assert plan.params.per_gpu == last_params
    assert plan.memory.optimizer == 12 * last_params / 2
    assert plan.memory.layer_activations == pytest.approx(6 * 34 * sbh_t)
    assert plan.memory.other_activations == pytest.approx(last_activations - 6 * 34 * sbh_t)
    # Selective recompute materialises one layer's attention scores again: 5as^2b/t.
    assert plan.memory.recompute_workspace == pytest.approx(5 * 12 * 2048 * 2048 * 4 / 2)


def test_175b_as_published(tmp_path: Path) -> None:
    """128 nodes x 8 GPUs, TP 8, PP 16, VP 6, sequence parallel, selective recompute, MBS 1,
    GBS 2048: the second recipe computed by hand."""
    h, s = 12288, 2048
    layer = (h * 3 * h + 3 * h) + (h * h + h) + (h * 4 * h + 4 * h + 4 * h * h + h) + 4 * h
    words = 51200 * h  # 50257 padded to a multiple of 128 x TP 8 = 1024
    total = words + s * h + 96 * layer + 2 * h
    # Each GPU holds 96 / 16 = 6 layers (6 virtual chunks of 1); GPU 0 also the embeddings.
    # Per TP rank a layer keeps 1/8 of 12h^2 + 7h (matrices, QKV and fc1 biases) and all of
    # the 6h of row-parallel biases and LayerNorms; the position table is whole on each rank.
    layer_rank = (12 * h * h + 7 * h) // 8 + 6 * h
    busiest = words // 8 + s * h + 6 * layer_rank
    plan = plan_of(tmp_path, recipe="175b")
    assert layer == 12 * h * h + 13 * h == 1_812_099_072 and total == 174_615_846_912
    assert plan.params.total == total and plan.params.per_gpu == busiest == 1_463_270_400
    assert plan.layout.data == 8 and plan.micro_batches == 256
    assert plan.memory.stage == "first"
    assert plan.memory.weights == 2 * busiest and plan.memory.gradients == 4 * busiest
    assert plan.memory.optimizer == 12 * busiest / 8
    # Selective recompute with sequence parallelism: s*b*h/t * 34 bytes per layer. The first
    # stage has p = 16 micro-batches in flight of its 6 layers, times 1 + (p-1)/(p*v): 111
    # layer-micro-batches, and as many embedding dropout masks of sbh/t bytes per 6 of them.
    sbh_t = s * 1 * h / 8
    assert plan.memory.layer_activations == pytest.approx(34 * sbh_t * 6 * 16 * (1 + 15 / 96))
    assert plan.memory.other_activations == pytest.approx(sbh_t * 16 * (1 + 15 / 96))
    assert plan.memory.recompute_workspace == pytest.approx(5 * 96 * s * s / 8)
    # 10.97 GB of weights and state, 11.87 GB of layer activations, 0.06 of the embedding's
    # masks and 0.25 of one layer's recomputed scores.
    assert plan.memory.total / 1e9 == pytest.approx(23.156, abs=0.001)


def test_a_recipe_that_cannot_fit_is_refused_naming_the_key(tmp_path: Path) -> None:
    plan = plan_of(
        tmp_path, "training.model.micro_batch_size=64", "training.model.global_batch_size=4096"
    )
    with pytest.raises(ConfigError) as error:
        check_fits(plan)
    assert str(error.value).startswith("training.model.micro_batch_size: the estimated ")
    assert "exceeds cluster.gpu_memory_gb=80" in str(error.value)


def test_dry_run_prints_the_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    without_slurm(monkeypatch)  # gpt3/126m's 8 nodes, for a cluster, not this machine's Slurm
    data = tmp_path / "data"
    (data / "bpe").mkdir(parents=True)
    for shard in range(30):
        for suffix in ("bin", "idx"):
            (data / f"my-gpt3_{shard:02d}_text_document.{suffix}").touch()
    (data / "bpe" / "merges.txt").touch()
    (data / "bpe" / "vocab.json").write_text("{}")
    result = run_main(
        "stages=[training]",
        "training=gpt3/126m",
        "cluster_type=bcm",
        "dry_run=true",
        f"data_dir={data}",
        f"base_results_dir={tmp_path}/results",
    )
    assert result.returncode == 0, result.stderr
    for row in ("nodes x GPUs          8 x 8 = 64", "TP/PP/VP/CP/DP        1/1/-/1/64"):
        assert row in result.stdout
    assert "memory per GPU" in result.stdout and "GB of 80 GB" in result.stdout
    assert "600,000 steps" in result.stdout  # max_steps, the default token count
