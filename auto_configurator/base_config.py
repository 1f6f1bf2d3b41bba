"""Base config generation: a training recipe for a model size that the training stage runs as is.

It starts from a shipped recipe (search_config.train_settings.base_recipe, e.g. gpt3/126m),
composed by the launcher so every key the stage reads is there, and changes the numbers: the
architecture (sizing.py's rule), sequence length, batch, nodes, steps for the tokens, time
limits and the parallel layout: the one the analytical model (a layer stack for GPT and BERT,
an encoder-decoder for T5 and mT5: searched_models.py) predicts fastest among those that fit.
The search then measures the best few.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from auto_configurator import sizing
from auto_configurator.candidates import (
    Candidate,
    Evaluated,
    SearchedModel,
    SearchSpace,
    evaluate,
    require_feasible,
    search_space,
)
from auto_configurator.recipes import (
    STAGE,
    check_family,
    compose_recipe,
    launcher_overrides,
    resolved_stage,
    set_keys,
    write_recipe,
)
from auto_configurator.searched_models import searched_model
from auto_configurator.settings import PREFIX, TrainSettings
from launcher_scripts import families
from launcher_scripts.costmodel.throughput import ClusterSpec
from launcher_scripts.recipes.layout import Layout

STOP_BEFORE_LIMIT_S = 1800  # trainer.max_time stops this long before the job's time limit


@dataclass(frozen=True)
class BaseConfig:
    path: Path
    size_in_b: float
    architecture: sizing.Architecture
    recipe: DictConfig  # the written training recipe, unresolved
    steps: int  # to train num_tokens_in_b
    days: float  # at tflops_per_gpu, from the model FLOPs of the architecture
    model: SearchedModel | None = None  # the analytical model's view of the recipe
    layout: Layout | None = None
    space: SearchSpace | None = None
    evaluated: tuple[Evaluated, ...] = ()
    on_gpu: bool = True

    @property
    def best(self) -> Evaluated | None:
        chosen = [e for e in self.evaluated if e.layout == self.layout]
        return chosen[0] if chosen else None


def size_label(size_in_b: float) -> str:
    """5 -> '5b', 0.126 -> '0.126b', 5.3763 -> '5.38b'."""
    return f"{float(f'{size_in_b:.3g}'):g}b"


def time_limit(days: float) -> str:
    """Slurm's D-HH:MM:SS."""
    seconds = max(60, int(days * sizing.SECONDS_PER_DAY))
    d, rest = divmod(seconds, 86400)
    return f"{d}-{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"


def max_time(seconds: float) -> str:
    """Lightning's DD:HH:MM:SS."""
    seconds = max(60, int(seconds))
    d, rest = divmod(seconds, 86400)
    return f"{d:02d}:{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"


def generate(cfg: DictConfig, settings: TrainSettings, size_in_b: float) -> BaseConfig:
    """Write `<logs>/base_cfg_<size>.yaml` and return it with the model's view of it."""
    recipe_key = f"{PREFIX}.base_recipe"
    root = compose_recipe(settings.base_recipe, launcher_overrides(cfg), recipe_key)
    recipe = root[STAGE]
    check_family(recipe, settings.family, recipe_key)
    family = families.of_model_type(settings.family)
    experts = recipe.model.get("num_moe_experts")
    if experts:
        # A mixture of experts is the base recipe's (its published size): the search chooses
        # its layout, EP included. The size rule is a dense stack's.
        arch = _recipe_architecture(recipe, settings, family)
    elif family.encoder_decoder:
        arch = sizing.encoder_decoder_architecture(size_in_b, settings.vocab_size)
    else:
        arch = sizing.stack_architecture(size_in_b, settings.vocab_size, settings.seq_length)
    seq = settings.seq_length
    gbs = settings.global_batch_size or sizing.global_batch_size(size_in_b, seq, settings.gpus)
    steps = max(1, math.ceil(settings.num_tokens_in_b * 1e9 / (gbs * seq)))
    lr = arch.lr
    common = {
        "run.name": f"{settings.family}_{size_label(size_in_b)}",
        "run.time_limit": time_limit(settings.max_training_days),
        "trainer.num_nodes": settings.num_nodes,
        "trainer.devices": settings.gpus_per_node,
        "trainer.max_steps": steps,
        "trainer.max_time": max_time(
            settings.max_training_days * sizing.SECONDS_PER_DAY - STOP_BEFORE_LIMIT_S
        ),
        "model.global_batch_size": gbs,
        "model.optim.lr": lr,
        "model.optim.sched.min_lr": lr / 10,
    }
    sched = recipe.model.optim.sched
    if "warmup_steps" in sched:
        # About 0.1% of the steps warm up (the GPT-3 126m recipe: 636 of 600,000), no plateau.
        common["model.optim.sched.warmup_steps"] = max(1, math.ceil(steps / 1000))
    if "constant_steps" in sched:
        common["model.optim.sched.constant_steps"] = 0
    set_keys(recipe, common)
    if experts:
        set_keys(recipe, {"model.encoder_seq_length": seq})
    elif family.encoder_decoder:
        _set_encoder_decoder(recipe, arch, seq)
    else:
        _set_stack(recipe, arch, seq)
    path = settings.logs / f"base_cfg_{size_label(size_in_b)}.yaml"
    training = resolved_stage(root)[STAGE]
    base = _choose_layout(recipe, training, settings, cfg, path, size_in_b, arch, steps)
    header = (
        f"Base config for a {size_label(size_in_b)} {settings.family} model, written by the "
        f"AutoConfigurator\nfrom the {settings.base_recipe} recipe: "
        f"{arch.num_layers} layers, hidden {arch.hidden_size}, "
        f"{arch.num_attention_heads} heads, FFN {arch.ffn_hidden_size}, about "
        f"{arch.parameters / 1e9:.3g}B parameters.\n"
        f"Run it: python3 main.py stages=[training] training={path}"
    )
    write_recipe(path, recipe, header)
    return base


def _recipe_architecture(
    recipe: DictConfig, settings: TrainSettings, family: families.ModelFamily
) -> sizing.Architecture:
    """The base recipe's own architecture (a mixture of experts'), its total parameters at the
    search's vocabulary."""
    model = OmegaConf.to_container(recipe.model, resolve=False)
    assert isinstance(model, dict)
    sizes = {k: recipe.model[k] for k in ("num_layers", "hidden_size", "num_attention_heads")}
    shape = family.shape(
        {**model, **sizes, "encoder_seq_length": settings.seq_length, "data": {}},
        settings.vocab_size,
        STAGE,
    )
    return sizing.Architecture(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        lr=float(recipe.model.optim.lr),
        parameters=shape.total_parameters(),
    )


def _set_stack(recipe: DictConfig, arch: sizing.Architecture, seq: int) -> None:
    set_keys(
        recipe,
        {
            "model.num_layers": arch.num_layers,
            "model.hidden_size": arch.hidden_size,
            "model.ffn_hidden_size": arch.ffn_hidden_size,
            "model.num_attention_heads": arch.num_attention_heads,
            "model.kv_channels": None,
            "model.init_method_std": arch.init_method_std,
            "model.encoder_seq_length": seq,
            "model.max_position_embeddings": seq,
        },
    )


def _set_encoder_decoder(recipe: DictConfig, arch: sizing.Architecture, seq: int) -> None:
    values: dict[str, object] = {"model.seq_length": seq}
    for block in ("encoder", "decoder"):
        values.update(
            {
                f"model.{block}.num_layers": arch.num_layers,
                f"model.{block}.hidden_size": arch.hidden_size,
                f"model.{block}.ffn_hidden_size": arch.ffn_hidden_size,
                f"model.{block}.num_attention_heads": arch.num_attention_heads,
                f"model.{block}.kv_channels": sizing.T5_KV_CHANNELS,
                f"model.{block}.init_method_std": arch.init_method_std,
            }
        )
    set_keys(recipe, values)


def cluster_spec(cfg: DictConfig, settings: TrainSettings) -> ClusterSpec:
    values = OmegaConf.to_container(cfg.cluster_spec, resolve=True) or {}
    values = {
        **values,
        "gpus_per_node": settings.gpus_per_node,
        "gpu_memory_gib": settings.gpu_memory_gb,
    }
    return ClusterSpec.from_settings(values, prefix="cluster_spec")


def _choose_layout(
    recipe: DictConfig,
    training: DictConfig,
    settings: TrainSettings,
    cfg: DictConfig,
    path: Path,
    size_in_b: float,
    arch: sizing.Architecture,
    steps: int,
) -> BaseConfig:
    model, layout = searched_model(training, settings, STAGE)
    on_gpu = str(training.trainer.get("accelerator", "gpu")) != "cpu"
    space = search_space(settings, model, on_gpu)
    evaluated = evaluate(
        space.candidates(),
        model,
        layout,
        space,
        cluster_spec(cfg, settings),
        settings.memory_limit_bytes,
    )
    best = require_feasible(evaluated, model, space, settings)[0]
    apply_layout(recipe, best.candidate)
    flops = model.flops_per_step(best.layout)
    days = sizing.days_to_train(flops, steps, settings.gpus, settings.tflops_per_gpu)
    return BaseConfig(
        path,
        size_in_b,
        arch,
        recipe,
        steps,
        days,
        model,
        best.layout,
        space,
        tuple(evaluated),
        on_gpu,
    )


def apply_layout(recipe: DictConfig, candidate: Candidate) -> None:
    """Give the recipe the candidate's parallel sizes, micro-batch and recomputation (keys a
    recipe may lack, such as its recomputation method, are added; BERT's missing
    context_parallel_size stays missing at CP 1)."""
    values = {}
    for override in candidate.overrides(STAGE, recipe.model):
        key, _, text = override.partition("=")
        values[key.removeprefix(f"{STAGE}.")] = _parse(text)
    set_keys(recipe, values, add=True)


def _parse(text: str) -> object:
    """An override's value as YAML reads it (null, true, 4)."""
    return OmegaConf.create(f"v: {text}").v
