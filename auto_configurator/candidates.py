"""The search space: candidate layouts, the rules that make a layout valid, the memory filter
and the ranking by predicted step time.

A candidate is TP, PP, VP (interleaved chunks), CP, sequence parallelism, micro-batch size,
activation recomputation and, for a mixture of experts, EP (each expert whole on a rank:
expert TP 1); nodes, GPUs, the global batch, precision and optimizer are the base
config's. Memory and step time come from the analytical model of the recipe's kind
(searched_models.py: a layer stack, or an encoder-decoder).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from auto_configurator.settings import PREFIX, TrainSettings
from launcher_scripts.config.checks import splits_heads
from launcher_scripts.costmodel.encoder_decoder import EncoderDecoderShape
from launcher_scripts.costmodel.memory import MemoryBreakdown
from launcher_scripts.costmodel.throughput import ClusterSpec, StepPrediction
from launcher_scripts.errors import ConfigError
from launcher_scripts.recipes.layout import Layout
from launcher_scripts.recipes.model_shape import ModelShape

AUTO_MICRO_BATCHES = (1, 2, 4, 8, 16)
AUTO_VIRTUAL_PIPELINE = (None, 2, 4, 8)
LONG_SEQUENCE = 8192  # auto searches context parallelism from this sequence length up


@dataclass(frozen=True)
class Candidate:
    tensor: int
    pipeline: int
    virtual_pipeline: int | None
    context: int
    sequence_parallel: bool
    micro_batch: int
    # None | "selective" | "full" (every layer) | N: full recomputation of the first N layers of
    # each pipeline stage (NeMo's act_ckpt_layers; megatron's "block" method)
    recompute: str | int | None
    expert: int = 0  # a mixture of experts' EP; 0: a model without experts

    @property
    def _recompute(self) -> tuple[str | None, str | None, int | None]:
        """(granularity, method, layers) as the recipe keys say them."""
        if isinstance(self.recompute, int):
            return "full", "block", self.recompute
        if self.recompute == "full":
            return "full", "uniform", 1
        return self.recompute, None, None

    def layout(self, base: Layout) -> Layout:
        granularity, method, layers = self._recompute
        return replace(
            base,
            tensor=self.tensor,
            pipeline=self.pipeline,
            virtual_pipeline=self.virtual_pipeline,
            context=self.context,
            sequence_parallel=self.sequence_parallel,
            micro_batch=self.micro_batch,
            recompute=granularity,
            recompute_method=method or "uniform",
            recompute_num_layers=layers or 1,
            expert=max(self.expert, 1),
            expert_tensor=1 if self.expert else None,
        )

    def overrides(self, stage: str = "training", recipe_model: Any = None) -> list[str]:
        """The launcher overrides that give a recipe (its `model` section, when given) this
        layout, in the keys the recipe declares: a recipe without context parallelism (BERT's)
        gets no context_parallel_size key at CP 1; an encoder-decoder recipe (T5's) gets its
        recomputation per block and its pipeline split rank."""
        model = f"{stage}.model"
        granularity, method, layers = self._recompute

        def declared(name: str) -> bool:
            return recipe_model is not None and name in recipe_model

        blocks = [f"{model}.{block}" for block in ("encoder", "decoder") if declared(block)]
        split = f"{model}.pipeline_model_parallel_split_rank={self.pipeline - 1}"
        with_context = recipe_model is None or declared("context_parallel_size") or self.context > 1
        recompute = [
            override
            for section in blocks or [model]
            for override in (
                f"{section}.activations_checkpoint_granularity={_yaml(granularity)}",
                f"{section}.activations_checkpoint_method={_yaml(method)}",
                f"{section}.activations_checkpoint_num_layers={_yaml(layers)}",
            )
        ]
        return [
            f"{model}.tensor_model_parallel_size={self.tensor}",
            f"{model}.pipeline_model_parallel_size={self.pipeline}",
            *([split] if declared("pipeline_model_parallel_split_rank") else []),
            f"{model}.virtual_pipeline_model_parallel_size={_yaml(self.virtual_pipeline)}",
            *([f"{model}.context_parallel_size={self.context}"] if with_context else []),
            f"{model}.sequence_parallel={_yaml(self.sequence_parallel)}",
            f"{model}.micro_batch_size={self.micro_batch}",
            *recompute,
            *(
                [
                    f"{model}.expert_model_parallel_size={self.expert}",
                    f"{model}.expert_tensor_parallel_size=1",
                ]
                if self.expert
                else []
            ),
        ]

    @property
    def label(self) -> str:
        vp = f" VP{self.virtual_pipeline}" if self.virtual_pipeline else ""
        sp = " SP" if self.sequence_parallel else ""
        if isinstance(self.recompute, int):
            recompute = f" full x{self.recompute}"
        else:
            recompute = f" {self.recompute}" if self.recompute else ""
        ep = f" EP{self.expert}" if self.expert else ""
        return (
            f"TP{self.tensor} PP{self.pipeline}{vp} CP{self.context}{ep}{sp} "
            f"MBS{self.micro_batch}{recompute}"
        )


def _yaml(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


@dataclass(frozen=True)
class SearchSpace:
    tensor: tuple[int, ...]
    pipeline: tuple[int, ...]
    virtual_pipeline: tuple[int | None, ...]
    context: tuple[int, ...]
    sequence_parallel: tuple[bool, ...]
    micro_batch: tuple[int, ...]
    recompute: tuple[str | int | None, ...]
    min_model_parallel: int
    max_model_parallel: int
    recompute_allowed: bool  # False on CPU: megatron-core's recomputation needs CUDA
    expert: tuple[int, ...] = (0,)  # a mixture of experts' EP sizes; (0,): no experts

    def candidates(self) -> list[Candidate]:
        return [
            Candidate(*values)
            for values in itertools.product(
                self.tensor,
                self.pipeline,
                self.virtual_pipeline,
                self.context,
                self.sequence_parallel,
                self.micro_batch,
                self.recompute,
                self.expert,
            )
        ]


def _expert_sizes(settings: TrainSettings, model: SearchedModel, world: int) -> tuple[int, ...]:
    auto = model.auto_expert(world)
    if auto == (0,):
        if settings.expert_parallel_sizes and settings.expert_parallel_sizes != (1,):
            raise ConfigError(
                f"{PREFIX}.expert_parallel_sizes",
                f"{list(settings.expert_parallel_sizes)}, but the model has no experts",
                "Set it to auto (or [1])",
            )
        return auto
    return settings.expert_parallel_sizes or auto


def _powers_of_two(limit: int) -> tuple[int, ...]:
    return tuple(2**i for i in range(limit.bit_length()) if 2**i <= limit)


class SearchedModel(Protocol):
    """What the search asks of a model kind (searched_models.py): the rules a layout must
    keep, the sizes `auto` searches, and the memory and step time of a layout."""

    shape: ModelShape | EncoderDecoderShape
    rules: tuple[Rule, ...]
    auto_virtual_pipeline: tuple[int | None, ...]

    def auto_pipeline(self, world: int) -> tuple[int, ...]: ...

    def auto_context(self) -> tuple[int, ...]: ...

    def auto_expert(self, world: int) -> tuple[int, ...]: ...

    def memory(self, layout: Layout) -> MemoryBreakdown: ...

    def predict(self, layout: Layout, cluster: ClusterSpec) -> StepPrediction: ...

    def flops_per_step(self, layout: Layout) -> float: ...


def search_space(settings: TrainSettings, model: SearchedModel, on_gpu: bool = True) -> SearchSpace:
    """The values each search key takes: the user's lists, or for `auto`: TP powers of two up to
    a node, the model's PP sizes (a layer stack: the divisors of its layers up to the GPUs),
    VP none/2/4/8 (none for T5), CP 1 (powers of two up to 8 from LONG_SEQUENCE tokens on a
    stack), SP on and off, MBS 1 to 16, recomputation none, selective and full (none only on
    CPU), model parallel size TP x PP from 1 to all GPUs, EP (a mixture of experts') the powers
    of two that divide its experts, up to the GPUs."""
    world = settings.gpus
    return SearchSpace(
        tensor=settings.tensor_parallel_sizes or _powers_of_two(min(settings.gpus_per_node, world)),
        pipeline=settings.pipeline_parallel_sizes or model.auto_pipeline(world),
        virtual_pipeline=settings.virtual_pipeline_sizes or model.auto_virtual_pipeline,
        context=settings.context_parallel_sizes or model.auto_context(),
        sequence_parallel=settings.sequence_parallel or (False, True),
        micro_batch=settings.micro_batch_sizes or AUTO_MICRO_BATCHES,
        recompute=settings.recompute or ((None, "selective", "full") if on_gpu else (None,)),
        expert=_expert_sizes(settings, model, world),
        min_model_parallel=settings.min_model_parallel_size or 1,
        max_model_parallel=settings.max_model_parallel_size or world,
        recompute_allowed=on_gpu,
    )


# ----- the rules ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    name: str  # what candidates.csv says about a layout that breaks it
    setting: str  # the train_settings key to change when no layout passes
    # (the model's shape: a ModelShape or an EncoderDecoderShape, the layout, the space)
    holds: Callable[[Any, Layout, SearchSpace], bool]
    fix: Callable[[Any, Layout, SearchSpace], str]


def _micro_batches_exact(layout: Layout) -> bool:
    """The global batch splits into whole micro-batches per data-parallel rank."""
    return layout.data > 0 and layout.global_batch % (layout.micro_batch * layout.data) == 0


RULES = (
    Rule(
        "heads % TP",
        "tensor_parallel_sizes",
        lambda s, lay, _: splits_heads(lay.tensor, s.num_attention_heads, s.query_groups),
        lambda s, _lay, _sp: (
            f"Choose TP sizes that divide the {s.num_attention_heads} heads "
            f"and {s.query_groups} query groups, e.g. [1, 2, 4]"
        ),
    ),
    Rule(
        "ffn % TP",
        "tensor_parallel_sizes",
        lambda s, lay, _: s.ffn_hidden_size % lay.tensor == 0,
        lambda s, _lay, _sp: f"Choose TP sizes that divide ffn_hidden_size {s.ffn_hidden_size}",
    ),
    Rule(
        "layers % (PP x VP)",
        "pipeline_parallel_sizes",
        lambda s, lay, _: s.num_layers % (lay.pipeline * (lay.virtual_pipeline or 1)) == 0,
        lambda s, _lay, _sp: (
            f"Choose PP (and VP) sizes whose product divides the {s.num_layers} layers"
        ),
    ),
    Rule(
        "GPUs % (TP x PP x CP)",
        "num_nodes",
        lambda _s, lay, _sp: lay.world_size % (lay.tensor * lay.pipeline * lay.context) == 0,
        lambda _s, lay, _sp: (
            f"Choose TP, PP and CP sizes whose product divides the {lay.world_size} GPUs"
        ),
    ),
    Rule(
        "model parallel size (TP x PP) out of bounds",
        "max_model_parallel_size",
        lambda _s, lay, sp: (
            sp.min_model_parallel <= lay.tensor * lay.pipeline <= sp.max_model_parallel
        ),
        lambda _s, _lay, sp: (
            f"Allow TP x PP sizes between min_model_parallel_size "
            f"{sp.min_model_parallel} and max_model_parallel_size {sp.max_model_parallel}"
        ),
    ),
    Rule(
        "GBS % (MBS x DP)",
        "micro_batch_sizes",
        # No data-parallel ranks at all (TP x PP x CP above the GPUs) is the GPU rule's case.
        lambda _s, lay, _sp: lay.data == 0 or _micro_batches_exact(lay),
        lambda _s, lay, _sp: (
            f"Choose micro-batch sizes that divide the global batch "
            f"{lay.global_batch} over the data-parallel ranks"
        ),
    ),
    Rule(
        "SP needs TP >= 2",
        "sequence_parallel",
        lambda _s, lay, _sp: not lay.sequence_parallel or lay.tensor >= 2,
        lambda _s, _lay, _sp: "Allow sequence_parallel false, or TP sizes of 2 and more",
    ),
    Rule(
        "seq % TP (SP)",
        "sequence_parallel",
        lambda s, lay, _: not lay.sequence_parallel or s.seq_length % lay.tensor == 0,
        lambda s, _lay, _sp: f"Choose TP sizes that divide seq_length {s.seq_length}",
    ),
    Rule(
        "seq % (2 x CP)",
        "context_parallel_sizes",
        lambda s, lay, _: lay.context == 1 or s.seq_length % (2 * lay.context) == 0,
        lambda s, _lay, _sp: f"Choose CP sizes with 2 x CP dividing seq_length {s.seq_length}",
    ),
    Rule(
        "VP needs PP >= 2",
        "virtual_pipeline_sizes",
        lambda _s, lay, _sp: lay.virtual_pipeline is None or lay.pipeline >= 2,
        lambda _s, _lay, _sp: "Allow null in virtual_pipeline_sizes, or PP sizes of 2 and more",
    ),
    Rule(
        "micro-batches % PP (interleaved)",
        "virtual_pipeline_sizes",
        lambda _s, lay, _sp: (
            lay.virtual_pipeline is None
            or not _micro_batches_exact(lay)
            or lay.micro_batches % lay.pipeline == 0
        ),
        lambda _s, _lay, _sp: (
            "Allow null in virtual_pipeline_sizes, or a global batch with "
            "a multiple of PP micro-batches"
        ),
    ),
    Rule(
        "experts % EP",
        "expert_parallel_sizes",
        lambda s, lay, _: s.experts is None or s.experts.count % lay.expert == 0,
        lambda s, _lay, _sp: f"Choose EP sizes that divide the {s.experts.count} experts",
    ),
    Rule(
        "GPUs % (EP x PP)",
        "expert_parallel_sizes",
        lambda _s, lay, _sp: lay.world_size % (lay.expert * lay.pipeline) == 0,
        lambda _s, lay, _sp: (
            f"Choose EP sizes whose product with PP divides the {lay.world_size} GPUs"
        ),
    ),
    Rule(
        "MoE under TP needs SP",
        "sequence_parallel",
        lambda s, lay, _: s.experts is None or lay.tensor == 1 or lay.sequence_parallel,
        lambda _s, _lay, _sp: (
            "Allow sequence_parallel true (megatron-core trains MoE under TP only so)"
        ),
    ),
    Rule(
        "recomputation needs CUDA",
        "act_ckpt_layers",
        lambda _s, lay, sp: sp.recompute_allowed or lay.recompute is None,
        lambda _s, _lay, _sp: "Set act_ckpt_layers=[0] for CPU runs",
    ),
)


def _rule(name: str) -> Rule:
    return next(rule for rule in RULES if rule.name == name)


def _both_blocks(s: EncoderDecoderShape) -> tuple[ModelShape, ModelShape]:
    return s.encoder, s.decoder


# T5 and mT5: both blocks' widths split by TP; the encoder on PP - 1 stages and the decoder on
# the last (recipes.training.encoder_decoder_split); no interleaving, no context parallelism.
ENCODER_DECODER_RULES = (
    Rule(
        "heads % TP",
        "tensor_parallel_sizes",
        lambda s, lay, _: all(
            splits_heads(lay.tensor, b.num_attention_heads, b.query_groups) for b in _both_blocks(s)
        ),
        lambda s, _lay, _sp: (
            f"Choose TP sizes that divide the encoder's {s.encoder.num_attention_heads} and the "
            f"decoder's {s.decoder.num_attention_heads} heads, e.g. [1, 2, 4]"
        ),
    ),
    Rule(
        "ffn % TP",
        "tensor_parallel_sizes",
        lambda s, lay, _: all(b.ffn_hidden_size % lay.tensor == 0 for b in _both_blocks(s)),
        lambda s, _lay, _sp: (
            f"Choose TP sizes that divide ffn_hidden_size {s.encoder.ffn_hidden_size} "
            f"(encoder) and {s.decoder.ffn_hidden_size} (decoder)"
        ),
    ),
    Rule(
        "encoder layers % (PP - 1)",
        "pipeline_parallel_sizes",
        lambda s, lay, _: lay.pipeline == 1 or s.encoder.num_layers % (lay.pipeline - 1) == 0,
        lambda s, _lay, _sp: (
            f"Choose PP sizes with PP - 1 dividing the {s.encoder.num_layers} encoder layers "
            "(the encoder runs on PP - 1 stages, the decoder on the last), e.g. [1, 2]"
        ),
    ),
    Rule(
        "no VP (encoder-decoder)",
        "virtual_pipeline_sizes",
        lambda _s, lay, _sp: lay.virtual_pipeline is None,
        lambda _s, _lay, _sp: (
            "Set virtual_pipeline_sizes=auto: the encoder-decoder schedule does not interleave"
        ),
    ),
    Rule(
        "no CP (encoder-decoder)",
        "context_parallel_sizes",
        lambda _s, lay, _sp: lay.context == 1,
        lambda _s, _lay, _sp: "Set context_parallel_sizes=[1]: T5 has no context parallelism",
    ),
    _rule("GPUs % (TP x PP x CP)"),
    _rule("model parallel size (TP x PP) out of bounds"),
    _rule("GBS % (MBS x DP)"),
    _rule("SP needs TP >= 2"),
    Rule(
        "seq % TP (SP)",
        "sequence_parallel",
        lambda s, lay, _: (
            not lay.sequence_parallel
            or (s.encoder_seq % lay.tensor == 0 and s.decoder_seq % lay.tensor == 0)
        ),
        lambda s, _lay, _sp: (
            f"Choose TP sizes that divide seq_length {s.encoder_seq} and seq_length_dec "
            f"{s.decoder_seq}"
        ),
    ),
    _rule("recomputation needs CUDA"),
)


def broken_rule(model: SearchedModel, layout: Layout, space: SearchSpace) -> Rule | None:
    """The first of the model's rules the layout breaks, or None when it is valid."""
    return next((rule for rule in model.rules if not rule.holds(model.shape, layout, space)), None)


# ----- evaluation and ranking --------------------------------------------------------------


@dataclass(frozen=True)
class Evaluated:
    candidate: Candidate
    layout: Layout
    broken: Rule | None = None
    memory: MemoryBreakdown | None = None
    prediction: StepPrediction | None = None
    memory_limit: float = 0.0  # bytes a layout may use per GPU

    @property
    def valid(self) -> bool:
        return self.broken is None

    @property
    def fits(self) -> bool:
        return self.memory is not None and self.memory.total <= self.memory_limit

    @property
    def feasible(self) -> bool:
        return self.valid and self.fits

    @property
    def status(self) -> str:
        if self.broken is not None:
            return f"invalid: {self.broken.name}"
        if not self.fits:
            return "exceeds memory"
        return "feasible"


def evaluate(
    candidates: Iterable[Candidate],
    model: SearchedModel,
    base: Layout,
    space: SearchSpace,
    cluster: ClusterSpec,
    memory_limit: float,
) -> list[Evaluated]:
    """Every candidate with its broken rule, or its predicted memory and step time."""
    evaluated = []
    for candidate in candidates:
        layout = candidate.layout(base)
        rule = broken_rule(model, layout, space)
        if rule is not None:
            evaluated.append(Evaluated(candidate, layout, rule, memory_limit=memory_limit))
            continue
        evaluated.append(
            Evaluated(
                candidate,
                layout,
                memory=model.memory(layout),
                prediction=model.predict(layout, cluster),
                memory_limit=memory_limit,
            )
        )
    return evaluated


def ranked(evaluated: Sequence[Evaluated]) -> list[Evaluated]:
    """The feasible candidates, predicted fastest first. Predictions equal to 3 significant
    digits go to the larger micro-batch (real kernels run larger matrices more efficiently,
    which the model leaves out), then to less memory."""
    feasible = [e for e in evaluated if e.feasible]

    def key(e: Evaluated) -> tuple[float, int, float]:
        return (float(f"{e.prediction.step_time_s:.3g}"), -e.candidate.micro_batch, e.memory.total)

    return sorted(feasible, key=key)


def require_feasible(
    evaluated: Sequence[Evaluated],
    model: SearchedModel,
    space: SearchSpace,
    settings: TrainSettings,
) -> list[Evaluated]:
    """The ranked feasible candidates; a one-line ConfigError when there are none."""
    best = ranked(evaluated)
    if best:
        return best
    valid = [e for e in evaluated if e.valid]
    if not valid:
        # The rule that breaks the most layouts (counting every rule each layout breaks): the
        # setting to change first.
        shape, rules = model.shape, model.rules
        counts = Counter(
            rule.name for e in evaluated for rule in rules if not rule.holds(shape, e.layout, space)
        )
        rule = max(rules, key=lambda r: counts[r.name])
        example = next(e for e in evaluated if not rule.holds(shape, e.layout, space))
        count = counts[rule.name]
        share = "all" if count == len(evaluated) else f"{count} of"
        raise ConfigError(
            f"{PREFIX}.{rule.setting}",
            f"no candidate layout is valid: {share} {len(evaluated)} break '{rule.name}'",
            rule.fix(shape, example.layout, space),
        )
    smallest = min(valid, key=lambda e: e.memory.total)
    raise ConfigError(
        f"{PREFIX}.gpu_memory_gb",
        f"no valid layout fits: the smallest needs {smallest.memory.total_gib:.1f} GiB per GPU "
        f"({smallest.candidate.label}) and {settings.gpu_memory_gb:g} GiB less the "
        f"{settings.memory_safety_margin:.0%} margin is {settings.memory_limit_bytes / 2**30:.1f}",
        "Add nodes, allow larger tensor/pipeline sizes, smaller micro-batches, or "
        "act_ckpt_layers with selective/full",
    )
