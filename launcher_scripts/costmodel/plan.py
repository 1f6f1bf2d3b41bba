"""The training stage's plan: layout, batch, parameters, memory per GPU against the GPU's,
model FLOPs per step and the time to train a number of tokens. Torch-free (preflight and
dry runs use it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher_scripts.costmodel import encoder_decoder, estimates, throughput
from launcher_scripts.costmodel.memory import MemoryBreakdown, memory_breakdown
from launcher_scripts.errors import ConfigError
from launcher_scripts.formats.portable import EMBEDDINGS
from launcher_scripts.formats.portable_check import PortableFileError, inspect_portable
from launcher_scripts.recipes import restore
from launcher_scripts.recipes.layout import Layout, read_layout
from launcher_scripts.recipes.model_shape import ModelShape, read_shape, tokenizer_vocab


@dataclass(frozen=True)
class TrainingPlan:
    nodes: int
    gpus_per_node: int
    layout: Layout
    seq: int
    vocab: int
    vocab_assumed: bool
    params: estimates.Parameters
    memory: MemoryBreakdown
    gpu_memory_gb: float | None
    flops_per_step: float
    tokens: float
    tflops_per_gpu: float
    on_gpu: bool

    @property
    def micro_batch(self) -> int:
        return self.layout.micro_batch

    @property
    def global_batch(self) -> int:
        return self.layout.global_batch

    @property
    def micro_batches(self) -> int:
        """Per step and data-parallel rank (gradient accumulation)."""
        return self.layout.micro_batches

    @property
    def steps(self) -> float:
        return self.tokens / (self.global_batch * self.seq)

    @property
    def days(self) -> float:
        gpus = self.nodes * self.gpus_per_node
        return self.steps * self.flops_per_step / (self.tflops_per_gpu * 1e12 * gpus) / 86400


@dataclass(frozen=True)
class Costs:
    params: estimates.Parameters
    memory: MemoryBreakdown
    flops_per_sample: float
    seq: int  # the tokens of one sample that `plan.num_tokens` counts


# (the family's shape of the recipe's model, the layout) -> its costs (ModelFamily.costs)
CostFunction = Callable[[Any, Layout], Costs]
# (the recipe's model section, its vocabulary, the stage) -> the family's shape of it
ShapeFunction = Callable[[Any, int, str], Any]


def stack_shape(model: Any, vocab: int, stage: str) -> ModelShape:
    """A decoder-only (GPT) or encoder-only (BERT) recipe's stack."""
    return read_shape(model, vocab_size=vocab, prefix=f"{stage}.model")


def decoder_stack_costs(shape: ModelShape, layout: Layout) -> Costs:
    """GPT, and BERT (the same layer stack; its small pooler and heads are left out), through
    the AutoConfigurator's analytical model."""
    memory = memory_breakdown(shape, layout)
    params = estimates.Parameters(
        shape.total_parameters(layout.tensor),
        memory.parameters_per_gpu,
        shape.active_parameters(layout.tensor) if shape.experts else None,
    )
    flops = throughput.model_flops_per_sample(shape, shape.padded_vocab(layout.tensor))
    return Costs(params, memory, flops, shape.seq_length)


def encoder_decoder_shape(
    model: Any, vocab: int, stage: str
) -> encoder_decoder.EncoderDecoderShape:
    """T5 and mT5: an encoder over seq_length tokens, a decoder over seq_length_dec."""
    return encoder_decoder.EncoderDecoderShape(model, vocab)


def encoder_decoder_costs(shape: encoder_decoder.EncoderDecoderShape, layout: Layout) -> Costs:
    memory = encoder_decoder.memory_breakdown(shape, layout)
    params = encoder_decoder.parameters(shape, layout)
    flops = encoder_decoder.model_flops_per_sample(shape, layout.tensor)
    return Costs(params, memory, flops, shape.encoder_seq)


DEFAULT_TFLOPS_PER_GPU = 140.0


def plan_settings(root: Any) -> tuple[float, float | None]:
    """The root's `plan` section: (model TFLOP/s per GPU, tokens to estimate the time for or
    None for the run's own steps), each a positive number."""
    settings = root.get("plan") or {}
    values: list[float | None] = []
    for name, default in (("tflops_per_gpu", DEFAULT_TFLOPS_PER_GPU), ("num_tokens", None)):
        value = settings.get(name)
        if value is None:
            values.append(default)
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ConfigError(
                f"plan.{name}", f"{value!r} is not a positive number", "Fix the value, or null"
            )
        values.append(float(value))
    tflops, tokens = values
    assert tflops is not None
    return tflops, tokens


def make_plan(
    root: Any, stage: str, shape_of: ShapeFunction, costs_of: CostFunction
) -> TrainingPlan:
    """`shape_of`, `costs_of`: the recipe's model family's (`ModelFamily.shape`, `.costs`)."""
    cfg = root[stage]
    model = cfg.model
    layout = read_layout(cfg, stage)
    vocab, assumed = model_vocab(model)
    costs = costs_of(shape_of(model, vocab, stage), layout)
    global_batch = layout.global_batch
    tflops_per_gpu, num_tokens = plan_settings(root)
    tokens = num_tokens or int(cfg.trainer.max_steps) * global_batch * costs.seq
    gpu_memory = (root.get("cluster") or {}).get("gpu_memory_gb")
    on_gpu = str(cfg.trainer.get("accelerator", "gpu")) != "cpu"
    return TrainingPlan(
        nodes=layout.num_nodes,
        gpus_per_node=layout.gpus_per_node,
        layout=layout,
        seq=costs.seq,
        vocab=vocab,
        vocab_assumed=assumed,
        params=costs.params,
        memory=costs.memory,
        gpu_memory_gb=float(gpu_memory) if gpu_memory else None,
        flops_per_step=costs.flops_per_sample * global_batch,
        tokens=float(tokens),
        tflops_per_gpu=tflops_per_gpu,
        on_gpu=on_gpu,
    )


def model_vocab(model: Any) -> tuple[int, bool]:
    """The vocabulary the plan counts, and whether it was assumed: a continued pretraining
    recipe's file's embedding rows (or its stated padded_vocab_size, before the file exists),
    else the tokenizer's."""
    restored = restore.restore_path(model)
    if restored and Path(restored).is_file():
        try:
            return inspect_portable(restored).shapes[EMBEDDINGS][0], False
        except (PortableFileError, KeyError):
            pass  # the preflight names what is wrong with the file
    if model.get("padded_vocab_size") is not None:
        return int(model.padded_vocab_size), False
    return tokenizer_vocab(model.tokenizer)


def check_fits(plan: TrainingPlan, stage: str = "training") -> None:
    """A GPU run whose estimate exceeds cluster.gpu_memory_gb is refused before submission."""
    if not plan.on_gpu or plan.gpu_memory_gb is None:
        return
    need = plan.memory.total / estimates.GB
    if need > plan.gpu_memory_gb:
        raise ConfigError(
            f"{stage}.model.micro_batch_size",
            f"the estimated {need:.1f} GB per GPU ({memory_terms(plan.memory)}) "
            f"exceeds cluster.gpu_memory_gb={plan.gpu_memory_gb:g}",
            "Lower micro_batch_size, turn on activations_checkpoint_granularity, use the "
            "distributed optimizer, or raise tensor/pipeline_model_parallel_size",
        )


def memory_terms(m: MemoryBreakdown, digits: int = 1) -> str:
    """The memory breakdown's parts in GB, for one line."""
    gb = estimates.GB
    terms = [
        f"weights {m.weights / gb:.{digits}f}",
        f"gradients {m.gradients / gb:.{digits}f}",
        f"optimizer {m.optimizer / gb:.{digits}f}",
        f"activations {m.layer_activations / gb:.{digits}f}",
        f"other activations {m.other_activations / gb:.{digits}f}",
    ]
    if m.recompute_workspace:
        terms.append(f"recompute {m.recompute_workspace / gb:.{digits}f}")
    if m.dispatch_workspace:
        terms.append(f"expert dispatch {m.dispatch_workspace / gb:.{digits}f}")
    return ", ".join(terms)


def describe(plan: TrainingPlan) -> list[str]:
    """The plan as aligned lines for the terminal."""
    par, m = plan.layout, plan.memory
    gb = estimates.GB
    budget = f" of {plan.gpu_memory_gb:g} GB" if plan.gpu_memory_gb and plan.on_gpu else ""
    vocab = f"vocab {plan.vocab}" + (" (assumed: tokenizer not readable yet)" * plan.vocab_assumed)
    rows = [
        (
            "nodes x GPUs",
            f"{plan.nodes} x {plan.gpus_per_node} = {plan.nodes * plan.gpus_per_node}",
        ),
        (
            "TP/PP/VP/CP/DP",
            f"{par.tensor}/{par.pipeline}/{par.virtual_pipeline or '-'}/{par.context}/{par.data}"
            + (" (sequence parallel)" if par.sequence_parallel else "")
            + (
                f", EP {par.expert} x expert TP {par.expert_tensor_size}"
                if par.expert > 1 or par.expert_tensor not in (None, par.tensor)
                else ""
            ),
        ),
        (
            "batch",
            f"MBS {plan.micro_batch}, GBS {plan.global_batch}, {plan.micro_batches} "
            "micro-batches per step (gradient accumulation)",
        ),
        (
            "parameters",
            f"{plan.params.total / 1e9:.3f} B"
            + (f", {plan.params.active / 1e9:.3f} B active" if plan.params.active else "")
            + f" ({plan.params.per_gpu / 1e9:.3f} B on the busiest GPU; {vocab})",
        ),
        (
            "memory per GPU",
            f"{memory_terms(m, 2).replace(', ', ' + ')} = {m.total / gb:.2f} GB{budget}"
            + (f" ({m.stage} pipeline stage)" if m.stage != "only" else ""),
        ),
        ("model FLOPs per step", f"{plan.flops_per_step:.3e}"),
        (
            "time to train",
            f"{plan.tokens / 1e9:.3g} B tokens = {plan.steps:,.0f} steps = {plan.days:.2f} days "
            f"at {plan.tflops_per_gpu:g} model TFLOP/s per GPU",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    return [f"  {name:<{width}}  {value}" for name, value in rows]
