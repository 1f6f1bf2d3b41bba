"""Memory per GPU of one training layout, on its most loaded pipeline stage.

Two published models, reproduced exactly where their assumptions hold, and generalised where a
recipe leaves them (grouped-query attention, FFN != 4h, gated MLPs, fp32, context parallelism):

[K] Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
    (arXiv:2205.05198). Activations assume 16-bit elements and 1-byte dropout masks; s sequence,
    b micro-batch, h hidden, a heads, t TP, p PP, v virtual-pipeline chunks, L layers,
    V vocabulary (the paper writes v for the vocabulary and m for the chunks).
    * Table 2 (derived in sections 4.1-4.2 and 5), per layer and micro-batch:
        no parallelism               sbh(34 + 5as/h)
        tensor parallel              sbh(10 + 24/t + 5as/(ht))
        tensor + sequence parallel   sbh/t (34 + 5as/h)
        selective recompute          the 5as/h (attention scores) term is gone
        full recompute               2sbh (the layer's input; /t with sequence parallelism)
      Term by term (section 4.1): attention 11sbh + 5as^2b (QKV input 2sbh, Q and K 4sbh,
      softmax output 2as^2b, its dropout mask as^2b and output 2as^2b, V 2sbh, output
      projection input 2sbh, dropout mask sbh); MLP 19sbh (fc1 input 2sbh, activation input
      8sbh, fc2 input 8sbh, dropout mask sbh); the two norms' inputs 4sbh. Tensor parallelism
      (section 4.2.1) splits 24sbh + 5as^2b; the other 10sbh (norm, QKV and fc1 inputs, the two
      masks) is replicated until sequence parallelism (section 4.2.2) splits it too.
      `layer_activation_bytes` computes these terms from the shape: Q/K/V and projection widths
      from heads, query groups and head dim, activation/fc2 inputs from ffn (x2 for gated fc1),
      e bytes per element (2; 4 in fp32) and 1 per mask; it equals the table for a GPT-3 shape.
    * Section 4.2.3, pipeline parallelism: the first stage holds L/p layers for each of the p
      micro-batches in flight (1F1B), sbhL/t (34 + 5as/h) in all; with the interleaved schedule
      of v model chunks the first stage holds
      L(1 + (p-1)/(pv)) layers' worth. This module counts in-flight micro-batches from the
      schedules themselves (megatron-core's
      forward_backward_pipelining_{without,with}_interleaving: rank r runs min(p-r-1, m)
      warm-up forwards, or min(2(p-r-1) + (v-1)p, mv) chunk forwards interleaved, then one more
      before its first backward). For rank 0 that is exactly the paper's p and
      p(1 + (p-1)/(pv)) whenever the step has enough micro-batches m, and fewer when it has not
      (min(p, m) without interleaving).
    * Section 4.3, total activations: beyond the layers, the first stage keeps the embedding
      dropout mask, sbhp/t (one per in-flight micro-batch, times the interleaving factor as
      Megatron-LM's theoretical_memory_usage.py applies it); without pipelining the one stage
      also keeps the final norm's input 2sbh/t, the output layer's input 2sbh/t and the fp32
      logits for the cross-entropy 4sbV/t: sbhL/t (p/L + delta_{p=1} 4/L (1 + V/h)) in all.
      The paper counts the first stage only; here, with p > 1, the last stage (its layers for
      its in-flight micro-batches, plus the norm, output-layer input and logits of one) is
      compared too, and the larger is reported. Without sequence parallelism the sequence-sized
      terms are not split by t (as Table 2's 10sbh), the logits still are (vocab-parallel).
      Megatron-LM's theoretical_memory_usage.py also counts the int64 token ids (8 bytes a
      token); the paper does not, nor does this module.
[D] Megatron-Core's distributed optimizer documentation
    (https://docs.nvidia.com/megatron-core/developer-guide/latest/api-guide/dist_optimizer.html),
    bytes per parameter, d the data-parallel size:
        16-bit parameters, 16-bit gradients   20    4 + 16/d
        bf16 parameters, fp32 gradients       18    6 + 12/d
        fp32 parameters, fp32 gradients       16    8 + 8/d
    split here as weights + gradients + optimizer state (fp32 main weights and Adam's two
    moments; with 16-bit gradients also an fp32 main gradient), the optimizer part divided by d
    under the distributed optimizer. megatron-core (and this launcher's trainer) keeps fp32 main
    gradients for fp16 and bf16 (grad_reduce_in_fp32): the 18 / 6 + 12/d row. It reduces
    gradients and shards the optimizer over the data-parallel group *with* context
    parallelism, so d here is DP x CP.

Parameters on a GPU: the word-embedding table (padded to a multiple of
make_vocab_size_divisible_by x t) and every weight matrix are split by TP; biases of
row-parallel layers, the norms and learned position embeddings are whole on every TP rank. With
PP the first stage holds the input embeddings (+ positions), the last the final norm and the
output layer (with tied embeddings its own copy of the word table, kept in sync by Megatron).
Context parallelism (CP) gives each rank s/cp of the sequence: every sequence-sized term is
divided by cp; attention scores are (s/cp) x s per head (local queries against all keys; fused
attention kernels keep none of them, so selective recompute's figure then applies).

Mixture-of-experts layers (megatron-core's MoELayer; derived here term by term as [K] derives
the dense MLP's, for its all-to-all dispatcher). Megatron-core trains them under TP only with
sequence parallelism, so each rank routes s b / t of the tokens (s b without TP), and each
token goes to k experts: k s b / t token copies leave the rank, and as many arrive on average
(balanced routing; with a capacity factor c and padding to it, exactly c k s b / t). With
expert tensor parallelism of size et the copies are gathered over the et ranks, whose experts'
weights are split et ways. Kept for backward per MoE layer and micro-batch, in place of the
dense MLP's activation and fc2 inputs:
    the experts' fc1 input (the permuted, dispatched tokens)   e c k s b h et / t
    their fc1 output (the activation's input)                  e c k s b fc1_e / t
    their fc2 input                                            e c k s b ffn_e / t
    the router's fp32 logits and probabilities                 8 s b E / t
    a shared expert: a dense MLP of its width                  e s b (fc1_s + ffn_s) / t
(c = 1 when dropless; fc1_e = 2 ffn_e gated). The router's input is the pre-MLP norm's output,
already counted as the dense fc1's input. `dispatch_workspace` is the dispatcher's transient
send and receive buffers of one layer, 2 e c k s b h et / t. Parameters: a MoE layer's routed
experts (E x the expert MLP) are split over EP x et instead of TP; the router and the shared
expert's gate are whole on every rank. Their optimizer state is sharded over the expert-data-
parallel group (world / (et x EP x PP)) instead of DP x CP. Every per-layer term is taken layer
by layer (a stack may mix dense and MoE layers, moe_layer_freq); a pipeline stage's chunk is
the layers it holds first.

Beyond the papers, `recompute_workspace` is what recomputation materialises again during one
layer's (or, full-uniform, one checkpointed group's) backward: the whole layer under full
recompute, the attention scores under selective. Left out, as no formula holds them: framework
buffers, allocator fragmentation, NCCL and kernel workspaces. Plan on headroom.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from launcher_scripts.recipes.layout import Layout
from launcher_scripts.recipes.model_shape import ModelShape

GIB = 2**30
MASK_BYTES = 1  # dropout masks are bytes
LOGIT_BYTES = 4  # the cross-entropy works on fp32 logits


@dataclass(frozen=True)
class ParameterBytes:
    """Bytes per parameter, per [D]."""

    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def bytes_per_parameter(
    dtype: str, distributed_optimizer: bool, data: int, fp32_grads: bool = True
) -> ParameterBytes:
    """[D]'s table: 20 / 4 + 16/d, 18 / 6 + 12/d, 16 / 8 + 8/d."""
    if dtype == "fp32":
        weights, gradients, optimizer = 4, 4, 8  # fp32 weights are the main copy: Adam's m, v
    elif fp32_grads:
        weights, gradients, optimizer = 2, 4, 12  # + fp32 main weights, m, v
    else:
        weights, gradients, optimizer = 2, 2, 16  # + fp32 main weights, main grads, m, v
    return ParameterBytes(
        weights, gradients, optimizer / data if distributed_optimizer else optimizer
    )


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU on the most loaded pipeline stage; the *_gib properties in GiB (2**30)."""

    parameters_per_gpu: int
    weights: float
    gradients: float
    optimizer: float
    layer_activations: float  # what the transformer layers hold
    other_activations: float  # embedding dropout mask, final norm, output layer, logits
    recompute_workspace: float = 0.0  # what one layer's recomputation materialises again
    stage: str = "only"  # "only" (no pipelining), "first" or "last" pipeline stage
    dispatch_workspace: float = 0.0  # a MoE layer's all-to-all send and receive buffers

    @classmethod
    def of(
        cls,
        params: int,
        per_param: ParameterBytes,
        layer_activations: float,
        other_activations: float,
        stage: str,
        recompute_workspace: float = 0.0,
        expert_params: int = 0,
        expert_per_param: ParameterBytes | None = None,
        dispatch_workspace: float = 0.0,
    ) -> MemoryBreakdown:
        """A GPU holding `params` parameters at [D]'s bytes each (and `expert_params` at
        `expert_per_param`'s: their optimizer is sharded over another group), and these
        activations."""
        experts = expert_per_param or per_param
        return cls(
            parameters_per_gpu=params + expert_params,
            weights=params * per_param.weights + expert_params * experts.weights,
            gradients=params * per_param.gradients + expert_params * experts.gradients,
            optimizer=params * per_param.optimizer + expert_params * experts.optimizer,
            layer_activations=layer_activations,
            other_activations=other_activations,
            recompute_workspace=recompute_workspace,
            stage=stage,
            dispatch_workspace=dispatch_workspace,
        )

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.layer_activations
            + self.other_activations
            + self.recompute_workspace
            + self.dispatch_workspace
        )

    @property
    def weights_gib(self) -> float:
        return self.weights / GIB

    @property
    def gradients_gib(self) -> float:
        return self.gradients / GIB

    @property
    def optimizer_gib(self) -> float:
        return self.optimizer / GIB

    @property
    def layer_activations_gib(self) -> float:
        return self.layer_activations / GIB

    @property
    def other_activations_gib(self) -> float:
        return self.other_activations / GIB

    @property
    def recompute_workspace_gib(self) -> float:
        return self.recompute_workspace / GIB

    @property
    def total_gib(self) -> float:
        return self.total / GIB

    def to_json(self) -> dict:
        return {
            "parameters_per_gpu": self.parameters_per_gpu,
            "weights_gib": self.weights_gib,
            "gradients_gib": self.gradients_gib,
            "optimizer_gib": self.optimizer_gib,
            "layer_activations_gib": self.layer_activations_gib,
            "other_activations_gib": self.other_activations_gib,
            "recompute_workspace_gib": self.recompute_workspace_gib,
            "dispatch_workspace_gib": self.dispatch_workspace / GIB,
            "total_gib": self.total_gib,
            "stage": self.stage,
        }


# ----- activations ---------------------------------------------------------------------------


def routed_copies(shape: ModelShape) -> float:
    """Token copies the experts compute per routed token: top-k, times the capacity factor
    when megatron-core pads each expert's input to its capacity."""
    experts = shape.experts
    assert experts is not None
    return experts.top_k * (experts.capacity_factor or 1.0)


def moe_mlp_bytes(shape: ModelShape, layout: Layout) -> tuple[float, float]:
    """A MoE layer's MLP terms per micro-batch on one GPU (see the module docstring), as
    (split by TP like the dense MLP's, the sequence-sized ones)."""
    experts = shape.experts
    assert experts is not None
    e, s, b = layout.element_bytes, shape.seq_length / layout.context, layout.micro_batch
    copies = routed_copies(shape)
    fc1 = experts.ffn_hidden_size * (2 if shape.gated_mlp else 1)
    split = e * s * b * copies * (fc1 + experts.ffn_hidden_size)
    if experts.shared_ffn_hidden_size:
        shared = experts.shared_ffn_hidden_size
        split += e * s * b * (shared * (2 if shape.gated_mlp else 1) + shared)
    sequence = e * s * b * copies * shape.hidden_size * layout.expert_tensor_size
    sequence += 8 * s * b * experts.count
    return split, sequence


def dispatch_bytes(shape: ModelShape, layout: Layout) -> float:
    """The all-to-all dispatcher's send and receive buffers of one MoE layer on one GPU."""
    if shape.experts is None:
        return 0.0
    e, s, b = layout.element_bytes, shape.seq_length / layout.context, layout.micro_batch
    tokens = routed_copies(shape) * s * b * layout.expert_tensor_size / layout.tensor
    return 2 * e * tokens * shape.hidden_size


def layer_activation_bytes(shape: ModelShape, layout: Layout, moe: bool = False) -> float:
    """What one layer (a MoE one with `moe`) keeps for backward, per micro-batch, on one GPU
    ([K] Table 2 generalised), under the layout's recompute granularity."""
    granularity = layout.recompute
    e = layout.element_bytes
    s = shape.seq_length / layout.context
    b, h, t = layout.micro_batch, shape.hidden_size, layout.tensor
    sequence_split = t if layout.sequence_parallel else 1
    if granularity == "full":
        return e * s * b * h / sequence_split  # the layer's input: 2sbh (/t with SP)
    # Norm inputs (2), QKV input and fc1 input: e bytes each; two hidden dropout masks.
    replicated = (4 * e + 2 * MASK_BYTES) * s * b * h
    # Q and K for the scores, V, the output projection's input; the activation's input (fc1's
    # output) and fc2's input.
    q, kv = shape.query_size, shape.kv_size
    split = e * s * b * (2 * q + 2 * kv)
    if moe:
        mlp, sequence = moe_mlp_bytes(shape, layout)
        split += mlp
        replicated += sequence
    else:
        split += e * s * b * (shape.fc1_size + shape.ffn_hidden_size)
    if granularity != "selective":
        # Softmax output and dropout output (e bytes) and the dropout mask, a x s_q x s_kv:
        # 5as^2b at e = 2. With CP the local s/cp queries meet all s keys.
        scores = (2 * e + MASK_BYTES) * shape.num_attention_heads * s * shape.seq_length * b
        split += scores
    return replicated / sequence_split + split / t


def output_activation_bytes(shape: ModelShape, layout: Layout) -> float:
    """[K] section 4.3 for one micro-batch on the stage with the output layer: the final norm's
    input 2sbh/t, the output layer's input 2sbh/t and the fp32 logits 4sbV/t."""
    s = shape.seq_length / layout.context
    b, t = layout.micro_batch, layout.tensor
    sequence_split = t if layout.sequence_parallel else 1
    hidden = 2 * layout.element_bytes * s * b * shape.hidden_size / sequence_split
    logits = LOGIT_BYTES * s * b * shape.padded_vocab(t) / t
    return hidden + logits


def embedding_activation_bytes(shape: ModelShape, layout: Layout) -> float:
    """[K] section 4.3: the embedding dropout's mask, sbh/t (with SP) per micro-batch."""
    s = shape.seq_length / layout.context
    sequence_split = layout.tensor if layout.sequence_parallel else 1
    return MASK_BYTES * s * layout.micro_batch * shape.hidden_size / sequence_split


def chunks_in_flight(layout: Layout, rank: int) -> int:
    """Model-chunk forwards whose activations pipeline rank `rank` holds at its peak: the
    warm-up forwards plus the one before the first backward, as megatron-core schedules them.
    Without interleaving a chunk is the rank's L/p layers; with it, L/(pv)."""
    p, m = layout.pipeline, layout.micro_batches
    if layout.virtual_pipeline:
        v = layout.virtual_pipeline
        return min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v)
    return min(p - rank, m)


def chunk_activation_bytes(
    shape: ModelShape, layout: Layout, first: int = 0
) -> tuple[float, float]:
    """(bytes one micro-batch leaves in the model chunk whose first layer is `first`,
    workspace of its recomputation)."""
    chunks = layout.pipeline * (layout.virtual_pipeline or 1)
    layers = shape.num_layers // chunks
    indices = range(first, first + layers)
    plain = replace(layout, recompute=None)
    kept = [layer_activation_bytes(shape, plain, shape.is_moe_layer(i)) for i in indices]
    if layout.recompute == "selective":
        selective = [layer_activation_bytes(shape, layout, shape.is_moe_layer(i)) for i in indices]
        return sum(selective), max(k - s for k, s in zip(kept, selective, strict=True))
    if layout.recompute != "full":
        return sum(kept), 0.0
    checkpoint = layer_activation_bytes(shape, layout)  # the layer's input, dense or MoE
    if layout.recompute_method == "block":
        recomputed = min(layout.recompute_num_layers, layers)
        stored = recomputed * checkpoint + sum(kept[recomputed:])
        return stored, max(kept[:recomputed]) if recomputed else 0.0
    group = max(1, min(layout.recompute_num_layers, layers))
    workspace = max(sum(kept[i : i + group]) for i in range(0, layers, group))
    return math.ceil(layers / group) * checkpoint, workspace


@dataclass(frozen=True)
class StageActivations:
    layers: float
    other: float
    workspace: float


def stage_activations(shape: ModelShape, layout: Layout, stage: str) -> StageActivations:
    """Activations on the "only", "first" or "last" pipeline stage."""
    rank = layout.pipeline - 1 if stage == "last" else 0
    first = rank * (shape.num_layers // layout.pipeline)
    per_chunk, workspace = chunk_activation_bytes(shape, layout, first)
    in_flight = chunks_in_flight(layout, rank)
    other = 0.0
    if stage in ("only", "first"):
        # One embedding output per in-flight micro-batch: the chunk count over v, which is
        # p(1 + (p-1)/(pv)) under interleaving, the factor Megatron applies.
        other += (
            embedding_activation_bytes(shape, layout) * in_flight / (layout.virtual_pipeline or 1)
        )
    if stage in ("only", "last"):
        other += output_activation_bytes(shape, layout)
    return StageActivations(per_chunk * in_flight, other, workspace)


# ----- parameters ----------------------------------------------------------------------------


def stage_layers(shape: ModelShape, layout: Layout, stage: str) -> range:
    per_stage = shape.num_layers // layout.pipeline
    first = (layout.pipeline - 1) * per_stage if stage == "last" else 0
    return range(first, first + (shape.num_layers if stage == "only" else per_stage))


def stage_expert_parameters(shape: ModelShape, layout: Layout, stage: str) -> int:
    """The routed experts' parameters one GPU of the stage holds (split over EP x et)."""
    layers = stage_layers(shape, layout, stage)
    moe = shape.moe_layers(layers.start, len(layers))
    if not moe:
        return 0
    return moe * shape.routed_expert_parameters(layout.expert, layout.expert_tensor_size)


def stage_parameters(shape: ModelShape, layout: Layout, stage: str) -> int:
    """Parameters one GPU of the "only", "first" or "last" stage holds."""
    t = layout.tensor
    span = stage_layers(shape, layout, stage)
    layers = shape.stack_parameters(
        span.start, len(span), t, layout.expert, layout.expert_tensor_size
    )
    words = shape.word_embedding_parameters(t)
    inputs = words + shape.position_parameters()
    if stage == "only":
        return inputs + layers + shape.norm_parameters() + (0 if shape.tied_embeddings else words)
    if stage == "first":
        return inputs + layers
    return layers + shape.norm_parameters() + words  # tied: the last stage's own copy


def memory_breakdown(shape: ModelShape, layout: Layout) -> MemoryBreakdown:
    """Memory per GPU on the most loaded pipeline stage (see the module docstring)."""
    per_param = bytes_per_parameter(
        layout.dtype,
        layout.distributed_optimizer,
        layout.data * layout.context,
        layout.fp32_grads,
    )
    expert_per_param = bytes_per_parameter(
        layout.dtype, layout.distributed_optimizer, layout.expert_data, layout.fp32_grads
    )
    stages = ("only",) if layout.pipeline == 1 else ("first", "last")
    breakdowns = []
    for stage in stages:
        experts = stage_expert_parameters(shape, layout, stage)
        params = stage_parameters(shape, layout, stage) - experts
        activations = stage_activations(shape, layout, stage)
        span = stage_layers(shape, layout, stage)
        moe = shape.moe_layers(span.start, len(span))
        breakdowns.append(
            MemoryBreakdown.of(
                params,
                per_param,
                activations.layers,
                activations.other,
                stage,
                recompute_workspace=activations.workspace,
                expert_params=experts,
                expert_per_param=expert_per_param,
                dispatch_workspace=dispatch_bytes(shape, layout) if moe else 0.0,
            )
        )
    return max(breakdowns, key=lambda breakdown: breakdown.total)
