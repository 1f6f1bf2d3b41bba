"""An encoder-decoder (T5, mT5) training layout: memory on the busiest GPU and the step time,
from the per-layer pieces in costmodel.estimates and the stack model's terms in
costmodel.throughput.

With pipeline parallelism the encoder's layers run on the first PP - 1 stages and the whole
decoder on the last (megatron-core's schedule hands one tensor between stages), so the stages
are unequal. The step time follows throughput.predict_step term by term, per stage:

* Compute: the stage's hardware FLOPs for its micro-batches, split over TP. An encoder stage
  runs L_enc / (PP - 1) self-attention layers over the encoder's tokens; the decoder stage
  runs every decoder layer (self-attention over the decoder's tokens, cross-attention from
  them to the encoder's) and the LM head. Recomputation adds a forward of every layer (full)
  or of the attention scores, cross-attention's included (selective).
* Tensor-parallel communication, per layer and micro-batch: an encoder layer's two
  all-reduces forward and two backward of s_enc b h; a decoder layer's three and three of
  s_dec b h (self-attention, cross-attention, MLP), plus one of s_enc b h for the gradient of
  the encoder output that its key/value projection reads (with sequence parallelism an
  all-gather forward and a reduce-scatter backward: the same volume). A recomputed forward
  runs its all-reduces again.
* Fixed cost per layer (`layer_overhead_us`): a decoder layer counts 1.5 layers, its
  cross-attention being a second attention block (norm, projections, scores) beside
  self-attention and MLP.
* Pipeline: with per-micro-batch stage times tau_i, 1F1B takes m max(tau) plus the fill and
  drain through the other stages, sum of tau_i over the others: the bubble. For equal stages
  that is (p-1)/m of the busiest stage's time, throughput's formula. Each stage boundary
  sends the encoder's output forward and its gradient back per micro-batch.
* Data-parallel reduction of the busiest stage's parameters, as for the stack.
Left out, as for the stack: the embedding copies' gradient all-reduce between the first and
the last stage (and the relative-bias tables'), and the optimizer step.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from launcher_scripts.costmodel import estimates, throughput
from launcher_scripts.costmodel.memory import MemoryBreakdown, bytes_per_parameter
from launcher_scripts.costmodel.throughput import ClusterSpec, StepPrediction, ring_seconds
from launcher_scripts.recipes.layout import Layout
from launcher_scripts.recipes.model_shape import ModelShape

GB = 1e9
# A decoder layer's fixed per-layer cost relative to an encoder layer's (see the docstring).
DECODER_LAYER_OVERHEAD = 1.5


@dataclass(frozen=True)
class EncoderDecoderShape:
    """A T5/mT5 recipe's `model` section (resolved: blocks, sequence lengths, recomputation)
    and its tokenizer's vocabulary."""

    model: Any
    vocab_size: int

    @property
    def encoder_seq(self) -> int:
        return int(self.model.data.seq_length)

    @property
    def decoder_seq(self) -> int:
        return int(self.model.data.seq_length_dec)

    def padded_vocab(self, tensor: int) -> int:
        return estimates.padded_vocab(self.vocab_size, self.model, tensor)

    def block(self, name: str, tensor: int = 1) -> ModelShape:
        """The `encoder` or `decoder` block as a stack shape over its own tokens."""
        seq = self.encoder_seq if name == "encoder" else self.decoder_seq
        return estimates.block_shape(self.model[name], seq, self.padded_vocab(tensor))

    @cached_property
    def encoder(self) -> ModelShape:
        return self.block("encoder")

    @cached_property
    def decoder(self) -> ModelShape:
        return self.block("decoder")


def encoder_stages(layout: Layout) -> int:
    """Stages the encoder spans: PP - 1 (recipes.training.encoder_decoder_split requires it)."""
    return max(1, layout.pipeline - 1)


def parameters(shape: EncoderDecoderShape, layout: Layout) -> estimates.Parameters:
    return estimates.encoder_decoder_parameters(
        shape.model,
        shape.padded_vocab(layout.tensor),
        layout.tensor,
        layout.pipeline,
        encoder_stages(layout),
    )


def memory_breakdown(shape: EncoderDecoderShape, layout: Layout) -> MemoryBreakdown:
    """Bytes per GPU on the busiest stage: weights, gradients and optimizer state of its
    parameters ([D], as the stack), activations from estimates.encoder_decoder_activations
    (recomputation as each block's settings say)."""
    params = parameters(shape, layout)
    layers, other = estimates.encoder_decoder_activations(
        shape.model,
        shape.encoder_seq,
        shape.decoder_seq,
        tensor=layout.tensor,
        sequence_parallel=layout.sequence_parallel,
        micro_batch=layout.micro_batch,
        micro_batches=layout.micro_batches,
        pipeline=layout.pipeline,
        encoder_stages=encoder_stages(layout),
        padded_vocab=shape.padded_vocab(layout.tensor),
        precision=layout.dtype,
    )
    per_param = bytes_per_parameter(
        layout.dtype, layout.distributed_optimizer, layout.data * layout.context
    )
    stage = "only" if layout.pipeline == 1 else "busiest"
    return MemoryBreakdown.of(params.per_gpu, per_param, layers, other, stage)


def model_flops_per_sample(shape: EncoderDecoderShape, tensor: int = 1) -> float:
    return estimates.encoder_decoder_flops_per_sample(
        shape.model, shape.encoder_seq, shape.decoder_seq, shape.padded_vocab(tensor)
    )


def model_flops_per_step(shape: EncoderDecoderShape, layout: Layout) -> float:
    return layout.global_batch * model_flops_per_sample(shape, layout.tensor)


@dataclass(frozen=True)
class _Block:
    """One block's per-layer, per-sequence figures for a layout."""

    layers: int
    forward_flops: float
    recompute_flops: float
    allreduces: float  # of the block's own s b h
    memory_allreduces: float  # of the encoder's s_enc b h (the decoder's key/value input)
    overhead_layers: float


def _blocks(
    shape: EncoderDecoderShape, encoder: ModelShape, decoder: ModelShape
) -> tuple[_Block, _Block]:
    """The encoder's and the decoder's figures; `encoder` and `decoder` are their stack shapes
    (vocabulary padded for the layout)."""
    model = shape.model
    seqs = (model.decoder, shape.decoder_seq, shape.encoder_seq)
    cross = estimates.cross_attention_forward_flops(*seqs)
    cross_scores = estimates.cross_attention_score_flops(*seqs)
    result = []
    # (block, stack, cross-attention FLOPs and its scores', all-reduces per pass, all-reduces
    # of the encoder's tokens, fixed cost in layers)
    for name, stack, extra, scores, count, memory, overhead in (
        ("encoder", encoder, 0.0, 0.0, 2, 0.0, 1.0),
        ("decoder", decoder, cross, cross_scores, 3, 1.0, DECODER_LAYER_OVERHEAD),
    ):
        forward = throughput.stack_forward_flops(stack, padded=True) / stack.num_layers + extra
        recompute = estimates.block_recompute(model[name])
        if recompute == "full":
            again, repeated = forward, 1.0
        elif recompute == "selective":
            again, repeated = throughput.attention_score_flops(stack) + scores, 0.0
        else:
            again, repeated = 0.0, 0.0
        result.append(
            _Block(
                layers=stack.num_layers,
                forward_flops=forward,
                recompute_flops=again,
                allreduces=count * (2 + repeated),
                memory_allreduces=memory,
                overhead_layers=overhead,
            )
        )
    return result[0], result[1]


@dataclass(frozen=True)
class _StageTime:
    """One pipeline stage's time for one micro-batch, by part."""

    compute: float
    overhead: float
    tp_comm: float

    @property
    def total(self) -> float:
        return self.compute + self.overhead + self.tp_comm

    def __add__(self, other: _StageTime) -> _StageTime:
        return _StageTime(
            self.compute + other.compute,
            self.overhead + other.overhead,
            self.tp_comm + other.tp_comm,
        )


def predict_step(
    shape: EncoderDecoderShape, layout: Layout, cluster: ClusterSpec
) -> StepPrediction:
    """The predicted step time and its parts (see the module docstring)."""
    t, p, m, b = layout.tensor, layout.pipeline, layout.micro_batches, layout.micro_batch
    encoder_shape, decoder_shape = shape.block("encoder", t), shape.block("decoder", t)
    encoder, decoder = _blocks(shape, encoder_shape, decoder_shape)
    e, hidden = layout.element_bytes, encoder_shape.hidden_size
    latency = cluster.collective_latency_us * 1e-6
    rate = cluster.peak_tflops * 1e12 * cluster.compute_efficiency
    tp_gbps = cluster.intra_node_gbps if t <= layout.gpus_per_node else cluster.inter_node_gbps
    encoder_bytes = e * shape.encoder_seq * b * hidden
    decoder_bytes = e * shape.decoder_seq * b * hidden

    def stage(block: _Block, layers: int, own_bytes: float) -> _StageTime:
        flops = layers * (3 * block.forward_flops + block.recompute_flops)
        allreduce = 2 * ring_seconds(own_bytes, t, tp_gbps, latency)
        memory_allreduce = 2 * ring_seconds(encoder_bytes, t, tp_gbps, latency)
        return _StageTime(
            compute=b * flops / t / rate,
            overhead=layers * block.overhead_layers * cluster.layer_overhead_us * 1e-6,
            tp_comm=layers
            * (block.allreduces * allreduce + block.memory_allreduces * memory_allreduce),
        )

    logits = 3 * throughput.logits_forward_flops(decoder_shape, shape.padded_vocab(t))
    head = _StageTime(compute=b * logits / t / rate, overhead=0.0, tp_comm=0.0)
    decoder_stage = stage(decoder, decoder.layers, decoder_bytes) + head
    encoder_stage = stage(encoder, encoder.layers // encoder_stages(layout), encoder_bytes)
    stages = (
        [encoder_stage + decoder_stage] if p == 1 else [*[encoder_stage] * (p - 1), decoder_stage]
    )
    busiest = max(stages, key=lambda s: s.total)
    bubble = sum(s.total for s in stages) - busiest.total

    p2p_bytes = encoder_bytes / t if layout.sequence_parallel else encoder_bytes
    pp_gbps = (
        cluster.intra_node_gbps
        if layout.world_size <= layout.gpus_per_node
        else cluster.inter_node_gbps
    )
    pp_comm = 0.0 if p == 1 else m * 2 * (latency + p2p_bytes / (pp_gbps * GB))

    dp_comm = throughput.dp_reduction_seconds(parameters(shape, layout).per_gpu, layout, cluster)
    dp_exposed = (1 - cluster.dp_overlap) * dp_comm

    step = m * busiest.total + bubble + pp_comm + dp_exposed
    model_flops = model_flops_per_step(shape, layout)
    recomputed = encoder.layers * encoder.recompute_flops + decoder.layers * decoder.recompute_flops
    return StepPrediction(
        model_flops_per_step=model_flops,
        compute_s=m * busiest.compute,
        tp_comm_s=m * busiest.tp_comm,
        pp_bubble_s=bubble,
        dp_comm_s=dp_comm,
        step_time_s=step,
        tflops_per_gpu=model_flops / step / layout.world_size / 1e12,
        dp_exposed_s=dp_exposed,
        hardware_flops_per_step=model_flops + layout.global_batch * recomputed,
        overhead_s=m * busiest.overhead,
        pp_comm_s=pp_comm,
    )


def with_recompute(model: Any, granularity: str | None, method: str | None, layers: Any) -> Any:
    """A copy of the recipe's `model` section whose two blocks recompute as given."""
    copied = copy.deepcopy(model)
    for block in ("encoder", "decoder"):
        copied[block]["activations_checkpoint_granularity"] = granularity
        copied[block]["activations_checkpoint_method"] = method
        copied[block]["activations_checkpoint_num_layers"] = layers
    return copied
