"""Every GPT-3 training recipe in conf/training/gpt3: consistent numbers, the published ones
pinned, and a Slurm script rendered for each (dry run: nothing is trained or submitted).

New recipes are picked up by the glob; nothing here needs a GPU.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf

from launcher_scripts.clusters.base import time_limit_seconds
from launcher_scripts.config.compose import compose_config, conf_dir
from launcher_scripts.config.preflight import resolve
from launcher_scripts.recipes.model_shape import EXPERT_KEYS
from launcher_scripts.recipes.training import parse_max_time
from tests.support.commands import run_main
from tests.support.dry_runs import without_slurm

RECIPE_DIR = conf_dir() / "training" / "gpt3"
RECIPES = sorted(path.stem for path in RECIPE_DIR.glob("*.yaml"))

# Keys a recipe may have beyond 126m's: the "improved" architecture's extras, and a mixture of
# experts' (tiny_moe: its experts, EP and expert TP, its rotary base).
EXTRA_KEYS = {"model.num_query_groups", "model.rotary_percentage", "model.rotary_base"}
EXTRA_KEYS |= {f"model.{name}" for name in EXPERT_KEYS}
EXTRA_KEYS |= {"model.expert_model_parallel_size", "model.expert_tensor_parallel_size"}

# The numbers the NeMo launcher publishes for these recipes (its README, section 5.2.1).
PUBLISHED: dict[str, dict[str, Any]] = {
    "5b": {
        "trainer.num_nodes": 16,
        "trainer.devices": 8,
        "trainer.precision": "bf16",
        "model.tensor_model_parallel_size": 1,
        "model.pipeline_model_parallel_size": 1,
        "model.virtual_pipeline_model_parallel_size": None,
        "model.num_layers": 24,
        "model.hidden_size": 4096,
        "model.num_attention_heads": 32,
        "model.encoder_seq_length": 2048,
        "model.micro_batch_size": 4,
        "model.global_batch_size": 2048,
        "model.optim.name": "distributed_fused_adam",
    },
    "175b": {
        "trainer.num_nodes": 128,
        "trainer.devices": 8,
        "trainer.precision": "bf16",
        "model.tensor_model_parallel_size": 8,
        "model.pipeline_model_parallel_size": 16,
        "model.virtual_pipeline_model_parallel_size": 6,
        "model.sequence_parallel": True,
        "model.num_layers": 96,
        "model.hidden_size": 12288,
        "model.num_attention_heads": 96,
        "model.encoder_seq_length": 2048,
        "model.micro_batch_size": 1,
        "model.global_batch_size": 2048,
        "model.optim.name": "distributed_fused_adam",
    },
}


@functools.cache
def training(name: str, data_dir: str = "/data", results: str = "/results") -> DictConfig:
    """The recipe composed as main.py composes it, every interpolation resolved (read only)."""
    cfg = compose_config(
        [
            f"training=gpt3/{name}",
            "stages=[training]",
            f"data_dir={data_dir}",
            f"base_results_dir={results}",
        ]
    )
    return resolve(cfg, ["training"]).training


def flat_keys(node: dict[str, Any], prefix: str = "") -> set[str]:
    keys = set()
    for key, value in node.items():
        keys.add(prefix + key)
        if isinstance(value, dict):
            keys |= flat_keys(value, f"{prefix}{key}.")
    return keys


def test_the_glob_finds_the_published_recipes() -> None:
    assert {"126m", "tiny", *PUBLISHED} <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_numbers_are_consistent(name: str) -> None:
    cfg = training(name)
    model, trainer = cfg.model, cfg.trainer
    tp = model.tensor_model_parallel_size
    pp = model.pipeline_model_parallel_size
    vp = model.virtual_pipeline_model_parallel_size
    cp = model.get("context_parallel_size", 1)
    heads, layers = model.num_attention_heads, model.num_layers
    world = trainer.num_nodes * trainer.devices

    assert world % (tp * pp * cp) == 0, f"TP x PP x CP does not divide {world} GPUs"
    dp = world // (tp * pp * cp)
    assert heads % tp == 0
    assert model.hidden_size % heads == 0
    assert model.encoder_seq_length <= model.max_position_embeddings
    assert model.data.seq_length == model.encoder_seq_length
    per_step = model.micro_batch_size * dp
    assert model.global_batch_size % per_step == 0, f"GBS is not a multiple of MBS x DP {per_step}"
    if vp is not None:
        assert pp >= 2
        assert layers % (pp * vp) == 0, f"{layers} layers do not split into PP x VP chunks"
        # The interleaved schedule runs micro-batches in groups of PP.
        assert (model.global_batch_size // per_step) % pp == 0
    else:
        assert layers % pp == 0
    if model.sequence_parallel:
        assert tp >= 2 and model.encoder_seq_length % tp == 0
    groups = model.get("num_query_groups")
    if groups is not None:
        assert heads % groups == 0 and groups % tp == 0
    if model.rampup_batch_size is not None:
        start, increment, _samples = model.rampup_batch_size
        assert start % per_step == 0 and increment % per_step == 0
        assert (model.global_batch_size - start) % increment == 0
    assert trainer.max_steps > model.optim.sched.warmup_steps + model.optim.sched.constant_steps
    # YAML 1.1 reads "1e-4" (no dot) as a string: the numbers must have come through as floats.
    for value in (model.optim.lr, model.optim.sched.min_lr, model.init_method_std):
        assert isinstance(value, float), value
    assert model.optim.sched.min_lr <= model.optim.lr
    assert parse_max_time(trainer.max_time) <= time_limit_seconds(
        cfg.run.time_limit, "training.run.time_limit"
    )


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_has_the_template_keys(name: str) -> None:
    """The same key set as 126m: a misspelt key would otherwise be silently ignored."""
    template = flat_keys(OmegaConf.to_container(training("126m")))
    keys = flat_keys(OmegaConf.to_container(training(name)))
    assert template - keys == set(), "missing"
    assert keys - template <= EXTRA_KEYS, "unknown"


def test_run_names_are_distinct() -> None:
    """Each recipe writes to base_results_dir/<run.name>: two recipes must not share one."""
    names = [training(name).run.name for name in RECIPES]
    assert len(set(names)) == len(names), names


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_numbers(name: str) -> None:
    cfg = training(name)
    actual = {key: OmegaConf.select(cfg, key) for key in PUBLISHED[name]}
    assert actual == PUBLISHED[name]
    assert cfg.run.name == f"gpt3_{name}"


def placeholder_inputs(cfg: DictConfig) -> None:
    """Empty files where preflight looks for the data shards and the tokenizer."""
    prefixes = [item for item in cfg.model.data.data_prefix if isinstance(item, str)]
    files = [Path(prefix + suffix) for prefix in prefixes for suffix in (".bin", ".idx")]
    tokenizer = cfg.model.tokenizer
    named = (tokenizer.model, tokenizer.vocab_file, tokenizer.merge_file)
    files += [Path(path) for path in named if path]
    for path in files:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_renders_a_slurm_script(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    without_slurm(monkeypatch)  # the published node counts: a real cluster's, not this machine's
    data, results = tmp_path / "data", tmp_path / "results"
    cfg = training(name, str(data), str(results))
    placeholder_inputs(cfg)
    result = run_main(
        f"training=gpt3/{name}",
        "stages=[training]",
        "cluster_type=bcm",
        "dry_run=true",
        f"base_results_dir={results}",
        f"data_dir={data}",
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    scripts = [path for path in results.rglob("*.sh") if "#SBATCH" in path.read_text()]
    assert len(scripts) == 1, scripts
    script = scripts[0].read_text()
    nodes, devices = cfg.trainer.num_nodes, cfg.trainer.devices
    published = PUBLISHED.get(name, {})
    assert nodes == published.get("trainer.num_nodes", nodes)
    assert devices == published.get("trainer.devices", devices)
    assert re.search(rf"^#SBATCH --nodes={nodes}$", script, re.M), script[:800]
    assert re.search(rf"^#SBATCH --ntasks-per-node={devices}$", script, re.M), script[:800]
