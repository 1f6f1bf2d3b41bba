"""The AutoConfigurator's size recommendation, base config, candidate filters, bad inputs, and a
real measured search on the CPU (two gloo processes, the local backend)."""

from __future__ import annotations

import csv
import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from auto_configurator import sizing
from auto_configurator.candidates import (
    RULES,
    Candidate,
    SearchSpace,
    broken_rule,
    evaluate,
    ranked,
    search_space,
)
from auto_configurator.main import main as autoconfig_main
from auto_configurator.runner import Measurement, Run, measure
from auto_configurator.searched_models import StackModel
from auto_configurator.settings import parse
from launcher_scripts.config.compose import compose_config
from launcher_scripts.costmodel.memory import memory_breakdown
from launcher_scripts.costmodel.throughput import ClusterSpec, predict_step
from launcher_scripts.errors import ConfigError
from launcher_scripts.recipes.layout import Layout
from launcher_scripts.recipes.model_shape import ModelShape
from tests.support.autoconfig import run_autoconfig, validate_training

# ----- size recommendation and the time to train ---------------------------------------------


def test_size_recommendation_against_a_hand_computation() -> None:
    # NeMo's documented example: 20 nodes of 8 GPUs, 5 days, 300B tokens, 140 TFLOP/s per GPU.
    # C = 160 x 140e12 x 5 x 86400 = 9.6768e21 FLOPs; N = C / (6 x 300e9) = 5.376e9.
    assert sizing.recommend_size_in_b(160, 140, 5, 300) == pytest.approx(5.376)
    # And back: 5B parameters on 300B tokens, 128 GPUs: 6 x 5e9 x 300e9 / (128 x 140e12) s.
    days = 6 * 5e9 * 300e9 / (128 * 140e12) / 86400
    assert sizing.days_to_train_6nd(5, 300, 128, 140) == pytest.approx(days)
    assert days == pytest.approx(5.813, abs=1e-3)


def test_architecture_rule_and_parameter_count() -> None:
    # 12 L h^2 + 13 L h + (V + s) h + 2 h for a GPT with FFN 4h, biases, learned positions.
    h, layers, vocab, seq = 4096, 24, 51200, 2048
    hand = 12 * layers * h * h + 13 * layers * h + (vocab + seq) * h + 2 * h
    assert sizing.stack_parameters(layers, h, 4 * h, vocab, seq) == hand
    shape = ModelShape(layers, h, 4 * h, 32, seq, vocab)  # the analytical model's count agrees
    assert shape.total_parameters() == hand
    arch = sizing.stack_architecture(5, vocab, seq)
    assert (arch.num_layers, arch.hidden_size, arch.num_attention_heads) == (24, 4096, 32)
    assert arch.parameters == hand and abs(arch.parameters / 5e9 - 1) < 0.05
    # The published GPT-3 shapes come back from their sizes.
    assert sizing.stack_architecture(0.126, 51200, 2048).num_layers == 12
    assert sizing.stack_architecture(175, 51200, 2048).num_layers == 96
    t5 = sizing.encoder_decoder_architecture(0.22, 29100)
    assert (t5.num_layers, t5.hidden_size, t5.ffn_hidden_size) == (12, 768, 2048)


def test_unknown_size_recommends_then_writes_a_base_config(tmp_path: Path) -> None:
    result = run_autoconfig("search_config=gpt3/unknown_size", f"base_results_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert "model size recommendation: 5.38b parameters" in result.stdout
    base = tmp_path / "gpt3" / "unknown_size_80gb" / "base_cfg_5.38b.yaml"
    assert base.is_file()
    assert "time to train 300B tokens" in result.stdout
    recipe = OmegaConf.load(base)
    assert recipe.trainer.num_nodes == 20 and recipe.trainer.devices == 8
    # 1024 sequences rounded to a multiple of the 160 GPUs; steps for 300B tokens.
    assert recipe.model.global_batch_size == 960
    assert recipe.trainer.max_steps == -(-300_000_000_000 // (960 * 2048))


# ----- base config ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "search_config", ["gpt3/0.126b", "gpt3/5b", "gpt3/175b", "t5/0.22b", "mt5/3.2b", "bert/4b"]
)
def test_base_config_passes_the_training_stage_validation(
    search_config: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    code = autoconfig_main([f"search_config={search_config}", f"base_results_dir={tmp_path}"])
    assert code == 0, capsys.readouterr().err
    (base,) = tmp_path.rglob("base_cfg_*.yaml")
    # On Slurm with 80 GB GPUs: the stage's memory check applies too. The Pile is not here,
    # so this is the dry run's validation (inputs may be missing).
    validate_training(base, "cluster_type=bcm", "dry_run=true", f"data_dir={tmp_path}")
    size = search_config.split("/")[1].removesuffix("b")
    assert base.name == f"base_cfg_{size}b.yaml"


def test_tiny_base_config_validates_against_real_data(
    prepared: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    overrides = ["search_config=gpt3/tiny", f"base_results_dir={tmp_path}"]
    code = autoconfig_main([*overrides, f"data_dir={prepared}/data"])
    assert code == 0, capsys.readouterr().err
    (base,) = tmp_path.rglob("base_cfg_*.yaml")
    validate_training(base, f"data_dir={prepared}/data")  # no dry run: the files must exist
    recipe = OmegaConf.load(base)
    assert (recipe.model.num_layers, recipe.model.hidden_size) == (4, 128)
    assert recipe.trainer.accelerator == "cpu"  # the gpt3/tiny recipe's, kept


# ----- candidate filters ---------------------------------------------------------------------

SHAPE = ModelShape(
    num_layers=8, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8, seq_length=512,
    vocab_size=1000,
)  # fmt: skip
STACK = StackModel(SHAPE)
BASE = Layout(num_nodes=1, gpus_per_node=8, global_batch=32)
SPACE = SearchSpace(
    tensor=(1,), pipeline=(1,), virtual_pipeline=(None,), context=(1,),
    sequence_parallel=(False,), micro_batch=(1,), recompute=(None,),
    min_model_parallel=1, max_model_parallel=8, recompute_allowed=True,
)  # fmt: skip
VALID = Candidate(2, 2, 2, 1, True, 2, "selective")  # DP 2, 8 micro-batches


def rule_named(name: str):  # type: ignore[no-untyped-def]
    return next(rule for rule in RULES if rule.name == name)


@pytest.mark.parametrize(
    ("candidate", "rule", "space"),
    [
        (Candidate(3, 1, None, 1, False, 1, None), "heads % TP", SPACE),
        (Candidate(1, 3, None, 1, False, 1, None), "layers % (PP x VP)", SPACE),
        (Candidate(2, 2, 8, 1, False, 1, None), "layers % (PP x VP)", SPACE),
        (Candidate(1, 1, None, 16, False, 1, None), "GPUs % (TP x PP x CP)", SPACE),
        (Candidate(1, 1, None, 1, False, 3, None), "GBS % (MBS x DP)", SPACE),
        (Candidate(1, 1, None, 1, True, 1, None), "SP needs TP >= 2", SPACE),
        (Candidate(1, 1, 2, 1, False, 1, None), "VP needs PP >= 2", SPACE),
        (Candidate(1, 1, None, 2, False, 1, None), "seq % (2 x CP)", SPACE),
        (Candidate(2, 4, None, 1, False, 1, None), "model parallel size (TP x PP) out of bounds",
         replace(SPACE, max_model_parallel=4)),
        (Candidate(1, 1, None, 1, False, 1, "full"), "recomputation needs CUDA",
         replace(SPACE, recompute_allowed=False)),
    ],
)  # fmt: skip
def test_each_rule_drops_what_it_must(candidate: Candidate, rule: str, space: SearchSpace) -> None:
    shape = SHAPE if rule != "seq % (2 x CP)" else ModelShape(8, 256, 1024, 8, 510, 1000)
    assert broken_rule(StackModel(shape), candidate.layout(BASE), space) is rule_named(rule)
    valid = VALID if space.recompute_allowed else replace(VALID, recompute=None)
    assert broken_rule(STACK, valid.layout(BASE), space) is None


def test_interleaving_needs_micro_batches_in_multiples_of_pp() -> None:
    # GBS 32, MBS 4, DP 2 (TP 1, PP 4): 4 micro-batches, a multiple of PP 4: valid.
    valid = Candidate(1, 4, 2, 1, False, 4, None)
    assert broken_rule(STACK, valid.layout(BASE), SPACE) is None
    # GBS 24 instead: 3 micro-batches, not a multiple of PP 4.
    layout = valid.layout(Layout(num_nodes=1, gpus_per_node=8, global_batch=24))
    assert broken_rule(STACK, layout, SPACE) is rule_named("micro-batches % PP (interleaved)")


def test_memory_filter_and_ranking_use_the_model() -> None:
    cluster = ClusterSpec()
    candidates = [
        VALID,
        Candidate(1, 1, None, 1, False, 4, None),
        Candidate(8, 1, None, 1, True, 4, None),
    ]
    needed = memory_breakdown(SHAPE, VALID.layout(BASE)).total
    for limit, fits in ((needed, True), (needed * 0.999, False)):
        (first, *_) = evaluate(candidates, STACK, BASE, SPACE, cluster, limit)
        assert first.memory == memory_breakdown(SHAPE, VALID.layout(BASE))
        assert first.fits is fits and first.feasible is fits
        assert first.status == ("feasible" if fits else "exceeds memory")
    everything = evaluate(candidates, STACK, BASE, SPACE, cluster, 1e12)
    order = ranked(everything)
    times = [predict_step(SHAPE, e.layout, cluster).step_time_s for e in order]
    assert times == sorted(times) and len(order) == 3


def test_a_number_of_checkpointed_layers_recomputes_the_first_layers_of_each_stage() -> None:
    """NeMo's act_ckpt_layers=N: full recomputation of N layers per stage (megatron's block
    method), between no recomputation and recomputing every layer."""
    train = OmegaConf.to_container(
        compose_autoconfig("search_config=gpt3/5b").search_config.train_settings, resolve=True
    )
    settings = parse("gpt3/5b", {**train, "act_ckpt_layers": [0, 2, "full"]})
    assert settings.recompute == (None, 2, "full")
    partial = Candidate(1, 2, None, 1, False, 1, 2)  # PP 2: 4 layers a stage, 2 recomputed
    assert partial.overrides()[-3:] == [
        "training.model.activations_checkpoint_granularity=full",
        "training.model.activations_checkpoint_method=block",
        "training.model.activations_checkpoint_num_layers=2",
    ]
    layout = partial.layout(BASE)
    assert (layout.recompute, layout.recompute_method, layout.recompute_num_layers) == (
        "full",
        "block",
        2,
    )
    memory = {
        name: memory_breakdown(SHAPE, replace(partial, recompute=name).layout(BASE))
        for name in (None, 2, "full")
    }
    assert memory["full"].layer_activations < memory[2].layer_activations
    assert memory[2].layer_activations < memory[None].layer_activations


def test_auto_search_space_on_cpu_has_no_recomputation() -> None:
    train = OmegaConf.to_container(
        compose_autoconfig("search_config=gpt3/5b").search_config.train_settings, resolve=True
    )
    settings = parse("gpt3/5b", train)
    shape = ModelShape(24, 4096, 16384, 32, 2048, 51200)
    assert search_space(settings, StackModel(shape), on_gpu=False).recompute == (None,)
    gpu = search_space(settings, StackModel(shape), on_gpu=True)
    assert gpu.recompute == (None, "selective", "full")
    assert gpu.tensor == (1, 2, 4, 8) and gpu.pipeline == (1, 2, 3, 4, 6, 8, 12, 24)


def compose_autoconfig(*overrides: str):  # type: ignore[no-untyped-def]
    from auto_configurator.config import compose_config as compose

    return compose(list(overrides))


# ----- bad inputs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["search_config=gpt3/9b"], "error: search_config=gpt3/9b: no such recipe. Available"),
        (
            ["search_config.train_settings.tensor_parallel_sizes=[3,5]"],
            "error: search_config.train_settings.tensor_parallel_sizes: no candidate layout is "
            "valid: all 1920 break 'heads % TP'. Choose TP sizes that divide the 32 heads",
        ),
        (
            ["search_config.train_settings.micro_batch_sizes=[3]"],
            "error: search_config.train_settings.micro_batch_sizes: no candidate layout is valid",
        ),
        (
            ["search_config.train_settings.gpu_memory_gb=1"],
            "error: search_config.train_settings.gpu_memory_gb: no valid layout fits",
        ),
        (
            ["search_config.train_settings.act_ckpt_layers=[-1]"],
            "error: search_config.train_settings.act_ckpt_layers: -1 is not a recomputation",
        ),
        (
            ["search_config.train_settings.num_nodes=0"],
            "error: search_config.train_settings.num_nodes: 0 is not an integer >= 1",
        ),
        (
            ["search_config=t5/0.22b", "search_config.train_settings.virtual_pipeline_sizes=[2]"],
            "error: search_config.train_settings.virtual_pipeline_sizes: no candidate layout is "
            "valid: all 840 break 'no VP (encoder-decoder)'",
        ),
        (
            # Whatever stops every run (here: no dataset) is reported before any run starts.
            ["run_training_hp_search=true", "data_dir=/nonexistent"],
            "error: training.model.data.data_prefix: /nonexistent/my-gpt3_00_text_document.bin "
            "does not exist",
        ),
        (
            ["search_config.train_settings.base_recipe=gpt3/9b"],
            "error: search_config.train_settings.base_recipe: 'gpt3/9b' is not a training recipe",
        ),
        (
            # 5.3's commands name NeMo's FasterTransformer checkout, with or without the `+`.
            ["fastertransformer_path=/opt/FasterTransformer"],
            "error: fastertransformer_path: is the NeMo AutoConfigurator's path to "
            "FasterTransformer, which this one does not use",
        ),
        (
            ["+fastertransformer_path=/opt/FasterTransformer"],
            "error: fastertransformer_path: is the NeMo AutoConfigurator's path",
        ),
        (["+run_training_hp_serch=true"], "error: run_training_hp_serch: is not a key of the"),
    ],
)
def test_bad_inputs_give_one_line_and_exit_2(
    overrides: list[str], expected: str, tmp_path: Path
) -> None:
    result = run_autoconfig(*overrides, f"base_results_dir={tmp_path}")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith(expected), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


# ----- recipe files outside conf/ --------------------------------------------------------------


def test_a_recipe_file_outside_conf_is_loaded_by_path(tmp_path: Path) -> None:
    recipe = compose_config(["training=gpt3/126m"]).training
    recipe.model.num_layers = 6
    path = tmp_path / "my_recipe.yaml"
    path.write_text(OmegaConf.to_yaml(recipe))
    cfg = compose_config([f"training={path}", "training.model.hidden_size=512"])
    assert cfg.training.model.num_layers == 6 and cfg.training.model.hidden_size == 512
    assert cfg.training.run.name == "gpt3_126m"  # interpolations resolve in the launcher root
    with pytest.raises(ConfigError, match="no such file"):
        compose_config([f"training={tmp_path}/missing.yaml"])
    with pytest.raises(ConfigError, match="no such recipe"):
        compose_config(["training=relative/file.yaml"])  # only absolute paths are files


# ----- reading a run ---------------------------------------------------------------------------


def write_run(run_dir: Path, times: list[float]) -> None:
    log_dir = run_dir / "results"
    log_dir.mkdir(parents=True)
    (run_dir / "c_hydra.yaml").write_text(f"exp_manager:\n  explicit_log_dir: {log_dir}\n")
    records = [
        {"step": i, "train_step_timing": t, "model_tflops_per_gpu": 1 / t, "peak_memory_gb": i}
        for i, t in enumerate(times, start=1)
    ]
    (log_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_measure_skips_warmup_and_detects_out_of_memory(tmp_path: Path) -> None:
    run = Run(1, VALID, tmp_path / "ok", ("python3",), warmup_steps=2)
    write_run(run.run_dir, [9.0, 5.0, 1.0, 3.0, 2.0])  # after 2 warm-up steps: 1, 3, 2
    record = {"state": "COMPLETED", "exit_code": 0, "log": str(tmp_path / "none.out")}
    assert measure(run, record, 0) == Measurement(
        "COMPLETED", 0, 2.0, 3, 0.5, 5, None, str(tmp_path / "none.out")
    )
    oom = Run(2, VALID, tmp_path / "oom", ("python3",), warmup_steps=2)
    log = tmp_path / "oom" / "log-c_1.out"
    log.parent.mkdir()
    log.write_text("step 1\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate\n")
    failed = measure(oom, {"state": "FAILED", "exit_code": 1, "log": str(log)}, 1)
    assert failed.failure == "out of memory" and not failed.measured
    other = measure(oom, {"state": "FAILED", "exit_code": 3, "log": str(tmp_path / "x")}, 1)
    assert other.failure == "failed with exit code 3"
    (tmp_path / "oom" / "autoconfig_launch.out").write_text(
        "error: training.model.x: is bad. Fix it\n"
    )
    refused = measure(oom, None, 2)
    assert refused.state == "REFUSED"
    assert refused.failure == "refused: error: training.model.x: is bad. Fix it"


# ----- the real search -------------------------------------------------------------------------

# The family searches check what differs by family (recipe keys, the T5 split): one run does.
ONE_RUN = "search_config.train_settings.limit_search_runs=1"


def real_search(
    search_config: str, prepared: Path, tmp_path: Path, *overrides: str
) -> tuple[subprocess.CompletedProcess, Path, list[dict[str, str]]]:
    """A measured search of a tiny search config on the CPU: (the process, its final_results
    folder, the rows of candidates.csv)."""
    result = run_autoconfig(
        f"search_config={search_config}",
        "run_training_hp_search=true",
        f"base_results_dir={tmp_path}",
        f"data_dir={prepared}/data",
        *overrides,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    final = tmp_path / f"{search_config}_2gb" / "final_results"
    with open(final / "candidates.csv") as handle:
        return result, final, list(csv.DictReader(handle))


def assert_runs_trained(measured: list[dict[str, str]]) -> None:
    """Each measured run really trained: 8 logged steps in its own metrics, 5 of them timed
    (8 less the 3 warm-up steps of the tiny search configs)."""
    for row in measured:
        metrics = Path(row["run_dir"]) / "results" / "metrics.jsonl"
        steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
        assert steps == list(range(1, 9)), steps
        assert int(row["measured_steps"]) == 5


def measured_best(
    final: Path, measured: list[dict[str, str]]
) -> tuple[dict[str, str], dict, Path, DictConfig]:
    """The fastest measured row is summary.json's best, and the best config is a recipe with its
    layout: (that row, the summary, the recipe, the recipe's model section)."""
    summary = json.loads((final / "summary.json").read_text())
    fastest = min(measured, key=lambda r: float(r["measured_step_time_s"]))
    assert summary["best"]["run"] == fastest["run"]
    best = Path(summary["best_config"])
    model = OmegaConf.load(best).model
    layout = (model.tensor_model_parallel_size, model.pipeline_model_parallel_size)
    assert layout == (int(fastest["tp"]), int(fastest["pp"]))
    assert model.micro_batch_size == int(fastest["mbs"])
    return fastest, summary, best, model


@pytest.mark.slow
def test_real_measured_search_on_cpu_picks_the_measured_fastest(
    prepared: Path, tmp_path: Path
) -> None:
    """gpt3/tiny on two CPU processes: two short runs through main.py and the local backend,
    the fewest a choice between measurements needs (each run is two job processes)."""
    two = "search_config.train_settings.limit_search_runs=2"
    result, final, rows = real_search("gpt3/tiny", prepared, tmp_path, two)
    measured = [r for r in rows if r["status"] == "measured"]
    assert len(measured) == 2, rows
    assert {r["status"] for r in rows} >= {"measured", "not run (below limit_search_runs)"}
    assert any(r["status"].startswith("invalid: ") for r in rows)
    assert_runs_trained(measured)
    fastest, summary, best, _ = measured_best(final, measured)
    assert summary["measured"] == len(measured) and summary["runs"] == 2
    top = (final / "top_configs.log").read_text().splitlines()
    assert fastest["run"] in top[1]
    # The best config is a recipe with the fastest layout that the training stage accepts.
    validate_training(best, f"data_dir={prepared}/data")
    assert (final / "predicted_vs_measured.png").stat().st_size > 0
    assert (final / "failed_jobs.csv").read_text().startswith("run,layout,state")
    assert "best: " + fastest["run"] in result.stdout


@pytest.mark.slow
def test_real_measured_bert_search_on_cpu(prepared_wordpiece: Path, tmp_path: Path) -> None:
    """bert/tiny (no context_parallel_size key in its family's recipes) on two CPU processes:
    one short run through main.py (the GPT search measures several), and a best config the
    training stage accepts."""
    _, final, rows = real_search("bert/tiny", prepared_wordpiece, tmp_path, ONE_RUN)
    measured = [r for r in rows if r["status"] == "measured"]
    assert len(measured) == 1, rows
    _, summary, best, model = measured_best(final, measured)
    assert "context_parallel_size" not in model
    assert not any("context_parallel_size" in o for o in summary["best"]["overrides"])
    validate_training(best, f"data_dir={prepared_wordpiece}/data")


@pytest.mark.slow
def test_real_measured_t5_search_on_cpu(prepared_wordpiece: Path, tmp_path: Path) -> None:
    """t5/tiny at PP 2 on two CPU processes: the encoder on stage 0 and the decoder on stage 1
    at the split rank the search sets, one short run, and a best config the stage accepts."""
    pipelined = "search_config.train_settings.pipeline_parallel_sizes=[2]"
    _, final, rows = real_search("t5/tiny", prepared_wordpiece, tmp_path, pipelined, ONE_RUN)
    assert {r["status"] for r in rows} == {
        "measured",
        "not run (below limit_search_runs)",
        "invalid: SP needs TP >= 2",
        "invalid: GPUs % (TP x PP x CP)",
    }
    measured = [r for r in rows if r["status"] == "measured"]
    assert len(measured) == 1, rows
    assert_runs_trained(measured)
    _, summary, best, model = measured_best(final, measured)
    assert not any("context_parallel_size" in o for o in summary["best"]["overrides"])
    assert model.pipeline_model_parallel_split_rank == 1
    for block in ("encoder", "decoder"):
        assert model[block].activations_checkpoint_granularity is None
    validate_training(best, f"data_dir={prepared_wordpiece}/data")


@pytest.mark.slow
def test_a_measured_search_runs_on_base_command_platform(
    prepared: Path, tmp_path: Path, bcp_node: Path
) -> None:
    """cluster_type=bcp (5.3's BCP command): the launcher inside the BCP job runs each measured
    run to its end through bcprun (here the stand-in, tests/support/bcp.py) and reads it."""
    result, final, rows = real_search(
        "gpt3/tiny",
        prepared,
        tmp_path,
        "cluster_type=bcp",
        "training_container=nvcr.io/nvidia/nemo:24.05",
        "search_config.train_settings.limit_search_runs=1",
    )
    measured = [r for r in rows if r["status"] == "measured"]
    assert len(measured) == 1, rows
    assert_runs_trained(measured)
    run_dir = Path(measured[0]["run_dir"])
    assert run_dir.parent.name == "training_logs"  # NeMo's folder names (5.3.2.4)
    recipe = OmegaConf.load(run_dir.parents[1] / "candidate_configs" / "candidate_1.yaml")
    assert recipe.trainer.max_steps == 8 and recipe.run.results_dir == str(run_dir)
    script = next(run_dir.rglob("*_submission.sh")).read_text()
    assert "bcprun" in script
    assert json.loads((final / "summary.json").read_text())["best"]["run"] == measured[0]["run"]
