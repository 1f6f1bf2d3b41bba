"""`estimate`: memory per GPU, model FLOPs and (on a described cluster) the step time of one
training layout, from a recipe and/or the recipe keys on the command line.

    python3 auto_configurator/main.py estimate training=gpt3/5b trainer.num_nodes=8
    python3 -m auto_configurator.estimate model.num_layers=96 model.hidden_size=12288 \\
        model.num_attention_heads=96 model.encoder_seq_length=2048 trainer.num_nodes=128 \\
        model.tensor_model_parallel_size=8 model.pipeline_model_parallel_size=16 cluster=h100 --json

Without a recipe: model.num_layers, model.hidden_size, model.num_attention_heads and
model.encoder_seq_length are required; the rest default to 1 node x 8 GPUs, no model
parallelism, bf16, the distributed optimizer, MBS 1, GBS = MBS x data-parallel size, FFN 4h,
GPT-2's vocabulary. A cluster is described by `cluster=h100` (the ClusterSpec defaults: H100
SXM, 989 dense bf16 TFLOP/s at 55%, NVLink 450 GB/s, 50 GB/s per GPU across nodes) or
`cluster=a100`, and/or any `cluster.<field>=<value>`; only then is the step time predicted.

A T5 or mT5 recipe (`training=t5/220m`) gives the parameters, the memory of its busiest
pipeline stage (cross-attention, the encoder on the stages before the split rank and the decoder
on the last, costmodel.encoder_decoder) and the model FLOPs, and on a described cluster the
step time of those unequal stages; its keys are set as model.encoder.<key> /
model.decoder.<key>.
"""

from __future__ import annotations

import difflib
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from launcher_scripts.costmodel import encoder_decoder
from launcher_scripts.costmodel.memory import GIB, MemoryBreakdown, memory_breakdown
from launcher_scripts.costmodel.plan import Costs
from launcher_scripts.costmodel.throughput import (
    CLUSTERS,
    ClusterSpec,
    StepPrediction,
    model_flops_per_step,
    predict_step,
)
from launcher_scripts.errors import ConfigError, LauncherError
from launcher_scripts.families import family_of
from launcher_scripts.formats.portable_check import GATED_ACTIVATIONS
from launcher_scripts.recipes.layout import Layout, check_layout, read_layout
from launcher_scripts.recipes.model_shape import ModelShape, read_shape, tokenizer_vocab

MODEL_KEYS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "encoder_seq_length",
    "max_position_embeddings",
    "micro_batch_size",
    "global_batch_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "sequence_parallel",
    "activations_checkpoint_granularity",
    "activations_checkpoint_method",
    "activations_checkpoint_num_layers",
    "optim.name",
    "padded_vocab_size",
    "make_vocab_size_divisible_by",
    "activation",
    "normalization",
    "bias",
    "share_embeddings_and_output_weights",
    "position_embedding_type",
    "tokenizer.type",
    "tokenizer.model",
    "tokenizer.vocab_file",
)
TRAINER_KEYS = ("num_nodes", "devices", "precision")
# An encoder-decoder recipe's blocks (model.encoder.<key>, model.decoder.<key>) and its own keys.
BLOCK_KEYS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "kv_channels",
    "activation",
    "normalization",
    "bias",
    "activations_checkpoint_granularity",
    "activations_checkpoint_method",
    "activations_checkpoint_num_layers",
)
ENCODER_DECODER_KEYS = (
    "model.pipeline_model_parallel_split_rank",
    "model.data.seq_length",
    "model.data.seq_length_dec",
    *(f"model.{block}.{key}" for block in ("encoder", "decoder") for key in BLOCK_KEYS),
)
KNOWN_KEYS = (
    *(f"model.{key}" for key in MODEL_KEYS),
    *(f"trainer.{key}" for key in TRAINER_KEYS),
    *ENCODER_DECODER_KEYS,
)
CHOICES = {
    "model.activation": ("gelu", "squared-relu", "relu", *GATED_ACTIVATIONS),
    "model.normalization": ("layernorm", "layernorm1p", "rmsnorm"),
    "model.position_embedding_type": ("learned_absolute", "rope"),
}
DEFAULTS = {
    "trainer": {"num_nodes": 1, "devices": 8, "precision": "bf16"},
    "model": {"micro_batch_size": 1, "optim": {"name": "distributed_fused_adam"}},
}
USAGE = (
    "usage: estimate [training=<recipe>] [model.<key>=<value> ...] [trainer.<key>=<value> ...]"
    " [cluster=h100|a100] [cluster.<field>=<value> ...] [--json]"
)


@dataclass(frozen=True)
class Request:
    recipe: str | None
    overrides: dict[str, Any]  # model.* and trainer.* keys
    cluster_preset: str | None
    cluster_settings: dict[str, Any]
    as_json: bool

    @property
    def cluster_described(self) -> bool:
        return self.cluster_preset is not None or bool(self.cluster_settings)


@dataclass(frozen=True)
class Estimate:
    shape: ModelShape
    layout: Layout
    vocab_assumed: bool
    memory: MemoryBreakdown
    model_flops_per_step: float
    cluster: ClusterSpec | None
    step: StepPrediction | None

    def to_json(self) -> dict:
        result: dict[str, Any] = {
            **self.memory.to_json(),
            "parameters_total": self.shape.total_parameters(self.layout.tensor),
            "parameters_active": self.shape.active_parameters(self.layout.tensor),
            "model_flops_per_step": self.model_flops_per_step,
            "model": asdict(self.shape),
            "padded_vocab_size": self.shape.padded_vocab(self.layout.tensor),
            "vocab_assumed": self.vocab_assumed,
            "layout": {
                **asdict(self.layout),
                "data": self.layout.data,
                "expert_data": self.layout.expert_data,
                "micro_batches": self.layout.micro_batches,
            },
        }
        return {**result, **cluster_json(self)}


def cluster_json(estimate: Estimate | EncoderDecoderEstimate) -> dict[str, Any]:
    """The predicted step and the memory verdict, on a described cluster."""
    if estimate.cluster is None or estimate.step is None:
        return {}
    return {
        "predicted_step_time_s": estimate.step.step_time_s,
        "tflops_per_gpu": estimate.step.tflops_per_gpu,
        "step": estimate.step.to_json(),
        "cluster": asdict(estimate.cluster),
        "fits": estimate.memory.total_gib <= estimate.cluster.gpu_memory_gib,
    }


def parse_args(argv: Sequence[str]) -> Request:
    recipe, preset, as_json = None, None, False
    overrides: dict[str, Any] = {}
    cluster: dict[str, Any] = {}
    for arg in argv:
        if arg == "--json":
            as_json = True
            continue
        key, sep, text = arg.partition("=")
        if not sep or not key:
            raise ConfigError(
                arg, "is not key=value", "Write overrides as e.g. model.num_layers=96"
            )
        value = parse_value(text)
        if key == "training":
            recipe = text
        elif key == "cluster":
            if text not in CLUSTERS:
                raise ConfigError(
                    key, f"{text!r} is not a cluster", f"Use one of: {', '.join(CLUSTERS)}"
                )
            preset = text
        elif key.startswith("cluster."):
            cluster[key.removeprefix("cluster.")] = value
        elif key in KNOWN_KEYS:
            if key in CHOICES and value not in CHOICES[key]:
                raise ConfigError(
                    key, f"{value!r} is not valid", f"Use one of: {', '.join(CHOICES[key])}"
                )
            overrides[key] = value
        else:
            close = difflib.get_close_matches(key, KNOWN_KEYS, n=1)
            hint = f"Did you mean {close[0]}? " if close else ""
            raise ConfigError(
                key, "is not a key estimate reads", f"{hint}Run with --help for the keys"
            )
    return Request(recipe, overrides, preset, cluster, as_json)


def parse_value(text: str) -> Any:
    """A value as YAML reads it (12 -> int, true -> bool, null -> None), else the text."""
    try:
        return yaml.safe_load(text) if text else None
    except yaml.YAMLError:
        return text


def recipe_config(request: Request) -> DictConfig:
    """The recipe's training section (or the defaults) with the command-line keys applied."""
    if request.recipe is None:
        cfg = OmegaConf.create(DEFAULTS)
    else:
        from launcher_scripts.config.compose import compose_config

        root = compose_config([f"training={request.recipe}"])
        OmegaConf.set_struct(root, False)
        cfg = root.training
    check_keys_fit(request, request.recipe is not None and is_encoder_decoder(cfg))
    for key, value in request.overrides.items():
        OmegaConf.update(cfg, key, value, merge=True)
    if cfg.model.get("global_batch_size") is None:
        cfg.model.global_batch_size = default_global_batch(cfg)
    return cfg


def is_encoder_decoder(cfg: DictConfig) -> bool:
    return family_of(cfg, "training").encoder_decoder


def check_keys_fit(request: Request, encoder_decoder: bool) -> None:
    """An encoder-decoder recipe sets its layers per block; a single stack has no blocks."""
    for key in request.overrides:
        name = key.removeprefix("model.")
        if encoder_decoder and name in (*BLOCK_KEYS, "encoder_seq_length"):
            hint = (
                "Use model.data.seq_length (and model.data.seq_length_dec)"
                if name == "encoder_seq_length"
                else f"Use model.encoder.{name} and/or model.decoder.{name}"
            )
            raise ConfigError(key, "is set per block in an encoder-decoder recipe", hint)
        if not encoder_decoder and key in ENCODER_DECODER_KEYS:
            raise ConfigError(
                key,
                "is a key of encoder-decoder recipes",
                "Use it with training=t5/<size> or training=mt5/<size>",
            )


def default_global_batch(cfg: DictConfig) -> Any:
    """One micro-batch per data-parallel rank; left as is where the numbers are not numbers
    (the model's own checks then name the key)."""
    model, trainer = cfg.model, cfg.trainer
    try:
        world = int(trainer.num_nodes) * int(trainer.devices)
        split = 1
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
        ):
            split *= int(model.get(name) or 1)
        return int(model.micro_batch_size) * max(1, world // split)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class EncoderDecoderEstimate:
    """A T5/mT5 recipe's costs (the launcher plan's) at its layout."""

    model: dict[str, Any]  # the blocks' shapes, the sequence lengths, the vocabulary
    par: Layout
    encoder_stages: int
    micro_batch: int
    global_batch: int
    micro_batches: int  # per step and data-parallel rank
    vocab_assumed: bool
    padded_vocab: int
    costs: Costs
    cluster: ClusterSpec | None
    step: StepPrediction | None

    @property
    def memory(self) -> MemoryBreakdown:
        return self.costs.memory

    @property
    def model_flops_per_step(self) -> float:
        return self.costs.flops_per_sample * self.global_batch

    def to_json(self) -> dict:
        par = self.par
        result: dict[str, Any] = {
            **self.memory.to_json(),
            "parameters_total": self.costs.params.total,
            "model_flops_per_step": self.model_flops_per_step,
            "model": self.model,
            "padded_vocab_size": self.padded_vocab,
            "vocab_assumed": self.vocab_assumed,
            "layout": {
                "world": par.world_size,
                "tensor": par.tensor,
                "pipeline": par.pipeline,
                "encoder_stages": self.encoder_stages,
                "sequence_parallel": par.sequence_parallel,
                "data": par.data,
                "micro_batch": self.micro_batch,
                "global_batch": self.global_batch,
                "micro_batches": self.micro_batches,
            },
        }
        return {**result, **cluster_json(self)}


def make_estimate(request: Request) -> Estimate | EncoderDecoderEstimate:
    cfg = recipe_config(request)
    cluster = None
    if request.cluster_described:
        base = asdict(CLUSTERS[request.cluster_preset or "h100"])
        cluster = ClusterSpec.from_settings({**base, **request.cluster_settings})
    if request.recipe is not None and is_encoder_decoder(cfg):
        return encoder_decoder_estimate(cfg, cluster)
    vocab, assumed = None, False
    if cfg.model.get("padded_vocab_size") is None:
        vocab, assumed = tokenizer_vocab(cfg.model.get("tokenizer") or {})
    shape = read_shape(cfg.model, vocab_size=vocab)
    layout = read_layout(cfg, "")
    check_layout(shape, layout)
    return Estimate(
        shape=shape,
        layout=layout,
        vocab_assumed=assumed,
        memory=memory_breakdown(shape, layout),
        model_flops_per_step=model_flops_per_step(shape, layout),
        cluster=cluster,
        step=predict_step(shape, layout, cluster) if cluster else None,
    )


def encoder_decoder_estimate(
    cfg: DictConfig, cluster: ClusterSpec | None
) -> EncoderDecoderEstimate:
    """The training stage's own checks of the recipe (one line for a bad key), then its plan's
    costs."""
    family = family_of(cfg, "training")
    family.validate(cfg, "training", lambda _path: True)
    model = cfg.model
    vocab, assumed = tokenizer_vocab(model.tokenizer)
    layout = read_layout(cfg, "training")
    shape = family.shape(model, vocab, "training")
    costs = family.costs(shape, layout)
    blocks = {
        block: {
            name: OmegaConf.select(model, f"{block}.{name}")
            for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
        }
        for block in ("encoder", "decoder")
    }
    return EncoderDecoderEstimate(
        model={
            **blocks,
            "seq_length": int(model.data.seq_length),
            "seq_length_dec": int(model.data.seq_length_dec),
            "vocab_size": vocab,
        },
        par=layout,
        encoder_stages=encoder_decoder.encoder_stages(layout),
        micro_batch=layout.micro_batch,
        global_batch=layout.global_batch,
        micro_batches=layout.micro_batches,
        vocab_assumed=assumed,
        padded_vocab=shape.padded_vocab(layout.tensor),
        costs=costs,
        cluster=cluster,
        step=encoder_decoder.predict_step(shape, layout, cluster) if cluster else None,
    )


def memory_section(estimate: Estimate | EncoderDecoderEstimate) -> tuple[str, list]:
    m = estimate.memory
    return (
        f"memory per GPU, GiB ({m.stage} pipeline stage)"
        if m.stage != "only"
        else "memory per GPU, GiB",
        [
            ("weights", f"{m.weights_gib:10.3f}"),
            ("gradients", f"{m.gradients_gib:10.3f}"),
            ("optimizer", f"{m.optimizer_gib:10.3f}"),
            ("layer activations", f"{m.layer_activations_gib:10.3f}"),
            ("other activations", f"{m.other_activations_gib:10.3f}"),
            ("recompute workspace", f"{m.recompute_workspace_gib:10.3f}"),
            *(
                [("expert dispatch", f"{m.dispatch_workspace / GIB:10.3f}")]
                if m.dispatch_workspace
                else []
            ),
            ("total", f"{m.total_gib:10.3f}" + fit_note(estimate)),
        ],
    )


def aligned(sections: list[tuple[str, list[tuple[str, str]]]]) -> list[str]:
    width = max(len(name) for _, rows in sections for name, _ in rows)
    lines: list[str] = []
    for title, rows in sections:
        lines.append(title)
        lines.extend(f"  {name:<{width}}  {value}" for name, value in rows)
    return lines


def encoder_decoder_table(estimate: EncoderDecoderEstimate) -> list[str]:
    par, model = estimate.par, estimate.model

    def block(name: str) -> str:
        b = model[name]
        return (
            f"{b['num_layers']} layers, hidden {b['hidden_size']}, {b['num_attention_heads']} "
            f"heads, FFN {b['ffn_hidden_size']}"
        )

    vocab = f"vocab {model['vocab_size']}" + (" (assumed)" if estimate.vocab_assumed else "")
    encoder_stages = (
        "stage 0" if estimate.encoder_stages == 1 else f"stages 0-{estimate.encoder_stages - 1}"
    )
    split = (
        f" (encoder on {encoder_stages}, decoder on stage {par.pipeline - 1})"
        if par.pipeline > 1
        else ""
    )
    params = estimate.costs.params
    sections: list[tuple[str, list[tuple[str, str]]]] = [
        (
            "model",
            [
                ("encoder", f"{block('encoder')}, seq {model['seq_length']}"),
                ("decoder", f"{block('decoder')}, seq {model['seq_length_dec']}"),
                ("vocabulary", f"{vocab}, padded to {estimate.padded_vocab}"),
                (
                    "parameters",
                    f"{params.total / 1e9:.3f} B, {params.per_gpu / 1e9:.3f} B on the busiest GPU",
                ),
                (
                    "layout",
                    f"{par.world_size} GPUs: TP {par.tensor}, PP {par.pipeline}{split}, DP "
                    f"{par.data}"
                    + (", SP" if par.sequence_parallel else "")
                    + f"; MBS {estimate.micro_batch}, GBS {estimate.global_batch} "
                    f"({estimate.micro_batches} micro-batches)",
                ),
            ],
        ),
        memory_section(estimate),
        ("compute", [("model FLOPs per step", f"{estimate.model_flops_per_step:.4e}")]),
    ]
    if estimate.step is not None:
        sections.append(step_section(estimate.step))
    return aligned(sections)


def table(estimate: Estimate) -> list[str]:
    """The estimate as aligned lines."""
    shape, layout, m = estimate.shape, estimate.layout, estimate.memory
    vocab = f"vocab {shape.vocab_size}" + (" (assumed)" if estimate.vocab_assumed else "")
    parallel = (
        f"TP {layout.tensor}, PP {layout.pipeline}, VP {layout.virtual_pipeline or '-'}, "
        f"CP {layout.context}, DP {layout.data}" + (", SP" if layout.sequence_parallel else "")
    )
    if shape.experts is not None:
        parallel += (
            f", EP {layout.expert} x expert TP {layout.expert_tensor_size} "
            f"(expert DP {layout.expert_data})"
        )
    recompute = f"{layout.recompute} recompute" if layout.recompute else "no recompute"
    optimizer = "distributed optimizer" if layout.distributed_optimizer else "optimizer per rank"
    sections: list[tuple[str, list[tuple[str, str]]]] = [
        (
            "model",
            [
                (
                    "shape",
                    f"{shape.num_layers} layers, hidden {shape.hidden_size}, "
                    f"{shape.num_attention_heads} heads ({shape.query_groups} query groups), "
                    f"FFN {shape.ffn_hidden_size}{' gated' if shape.gated_mlp else ''}, "
                    f"seq {shape.seq_length}",
                ),
                *experts_rows(shape),
                ("vocabulary", f"{vocab}, padded to {shape.padded_vocab(layout.tensor)}"),
                (
                    "parameters",
                    f"{shape.total_parameters(layout.tensor) / 1e9:.3f} B"
                    + (
                        f", {shape.active_parameters(layout.tensor) / 1e9:.3f} B active"
                        if shape.experts
                        else ""
                    )
                    + f", {m.parameters_per_gpu / 1e9:.3f} B on the busiest GPU",
                ),
                (
                    "layout",
                    f"{layout.num_nodes} x {layout.gpus_per_node} GPUs: {parallel}; MBS "
                    f"{layout.micro_batch}, GBS {layout.global_batch} "
                    f"({layout.micro_batches} micro-batches)",
                ),
                ("training", f"{layout.dtype}, {recompute}, {optimizer}"),
            ],
        ),
        memory_section(estimate),
        ("compute", [("model FLOPs per step", f"{estimate.model_flops_per_step:.4e}")]),
    ]
    if estimate.step is not None:
        sections.append(step_section(estimate.step))
    return aligned(sections)


def experts_rows(shape: ModelShape) -> list[tuple[str, str]]:
    experts = shape.experts
    if experts is None:
        return []
    shared = (
        f", a shared expert of {experts.shared_ffn_hidden_size}"
        if experts.shared_ffn_hidden_size
        else ""
    )
    capacity = (
        f"capacity factor {experts.capacity_factor:g}" if experts.capacity_factor else "dropless"
    )
    return [
        (
            "experts",
            f"{experts.count} of FFN {experts.ffn_hidden_size}, top {experts.top_k}{shared}, in "
            f"{shape.moe_layers()} of {shape.num_layers} layers, {capacity}",
        )
    ]


def step_section(step: StepPrediction) -> tuple[str, list[tuple[str, str]]]:
    return (
        "predicted step, seconds",
        [
            ("compute", f"{step.compute_s:10.4f}"),
            ("fixed per-layer cost", f"{step.overhead_s:10.4f}"),
            ("TP communication", f"{step.tp_comm_s:10.4f}"),
            ("CP communication", f"{step.cp_comm_s:10.4f}"),
            ("pipeline bubble", f"{step.pp_bubble_s:10.4f}"),
            ("pipeline sends", f"{step.pp_comm_s:10.4f}"),
            *([("EP all-to-all", f"{step.ep_comm_s:10.4f}")] if step.ep_comm_s else []),
            (
                "DP gradient reduction",
                f"{step.dp_comm_s:10.4f} ({step.dp_exposed_s:.4f} exposed)",
            ),
            ("step time", f"{step.step_time_s:10.4f}"),
            ("model TFLOP/s per GPU", f"{step.tflops_per_gpu:10.1f}"),
        ],
    )


def fit_note(estimate: Estimate | EncoderDecoderEstimate) -> str:
    if estimate.cluster is None:
        return ""
    budget = estimate.cluster.gpu_memory_gib
    verdict = "fits" if estimate.memory.total <= budget * GIB else "does NOT fit"
    return f"  of {budget:g} GiB: {verdict}"


def main(argv: Sequence[str]) -> int:
    if any(arg in ("-h", "--help") for arg in argv):
        print(USAGE)
        print("keys: " + ", ".join(KNOWN_KEYS))
        print("cluster fields: " + ", ".join(asdict(ClusterSpec())))
        return 0
    try:
        request = parse_args(argv)
        estimate = make_estimate(request)
    except (LauncherError, OmegaConfBaseException) as error:
        message = " ".join(str(error).split())
        print(f"error: {message}", file=sys.stderr)
        return LauncherError.exit_code
    if request.as_json:
        print(json.dumps(estimate.to_json(), indent=2))
    elif isinstance(estimate, EncoderDecoderEstimate):
        print("\n".join(encoder_decoder_table(estimate)))
    else:
        print("\n".join(table(estimate)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
