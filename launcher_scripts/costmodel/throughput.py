"""Step time of one training layout on a described cluster, from first principles.

* Model FLOPs: the standard Megatron count. Narayanan et al. 2021, "Efficient Large-Scale
  Language Model Training on GPU Clusters Using Megatron-LM" (arXiv:2104.04473), derive
  96 B s L h^2 (1 + s/(6h) + V/(16 L h)) FLOPs per step of B sequences for the GPT-3 shape with
  full recomputation (four passes over the layers, three over the logits); without
  recomputation that is 72 B s L h^2 (1 + s/(6h) + V/(12 L h)), the model-FLOPs count of
  Korthikanti et al. 2022 and of Megatron-LM's num_floating_point_operations. Here it is
  counted matmul by matmul (2 FLOPs a multiply-add, backward twice the forward) so that it
  holds for grouped-query attention, FFN != 4h and gated MLPs: per layer and sequence the QKV
  projection s h (q + 2 kv), the attention output projection s q h, the scores and their
  product with V 2 s^2 q, fc1 s h ffn (x2 gated) and fc2 s ffn h multiply-adds; the logits
  s h V with V the padded vocabulary. For the GPT-3 shape it equals the 72 formula.
  Recomputation does not change model FLOPs.
* Hardware FLOPs add what recomputation runs again: one more forward of every recomputed
  layer (full: the 96 formula above), or of the attention scores and their product with V
  (selective).
* Compute time: the busiest pipeline stage's hardware FLOPs for its micro-batches, split over
  TP x CP, at `compute_efficiency` x `peak_tflops`.
* Tensor-parallel communication: per layer and micro-batch two all-reduces of the s b h
  activations in the forward and two in the backward (with sequence parallelism an all-gather
  and a reduce-scatter each, the same volume), two more when the layer's forward is
  recomputed; a ring moves 2 (t-1)/t of the bytes at NVLink bandwidth when the TP group fits in
  a node, else at the inter-node bandwidth. Not overlapped with compute. Each of a ring's n-1
  steps also pays `collective_latency_us` (the alpha of the alpha-beta model): on small
  tensors, as with small models or many micro-batches, it is most of the time.
* Context-parallel communication (cp > 1): the ring exchange of K and V, cp-1 hops of
  2 (s/cp) b kv / t elements in the forward and twice that (K, V and their gradients) in the
  backward, per layer and micro-batch; counted in full (Megatron hides part of it under the
  attention kernels, so this is an upper bound).
* Pipeline bubble: (p-1)/(m v) of the per-stage time (compute and TP/CP communication), m
  micro-batches, v virtual stages (Narayanan et al. 2021, section 2.2).
* Data-parallel gradient reduction over the DP x CP group: with the distributed optimizer a
  reduce-scatter of the gradients and an all-gather of the updated weights, (d-1)/d of each;
  otherwise an all-reduce, 2 (d-1)/d of the gradients; inter-node bandwidth when the group
  spans nodes (ranks are ordered TP, CP, DP, PP). `dp_overlap` of it is hidden under the
  backward pass.
* Fixed cost per layer: `layer_overhead_us` per layer, micro-batch and pass (forward and
  backward together) that does not shrink with the micro-batch or with TP: operator dispatch
  and kernel launches that the compute does not hide. Negligible for large models on GPUs
  (launches run ahead of long kernels: the default is 0), but it dominates small models and
  micro-batches, and on a CPU it is most of the step (bench/autoconfig.py measures it). It
  is what makes TP lose to DP on small models: TP splits the FLOPs, not the operator count.
* Pipeline point-to-point: per micro-batch and model chunk, each stage boundary sends the s b h
  activations forward and their gradient back (divided by t under sequence parallelism),
  each paying `collective_latency_us`; inter-node bandwidth unless the whole model-parallel
  group fits in a node.
* Mixture-of-experts layers: a token's MLP FLOPs are its k routed experts', the shared
  expert's and the router's (h x E), so model FLOPs count active parameters only; hardware
  FLOPs also count the padding when each expert's input is padded to a capacity factor c
  (c k expert MLPs a token). Expert parallelism: per MoE layer and micro-batch the dispatcher's
  all-to-all sends the rank's c k s b / t routed token copies (x et under expert TP) to the
  EP ranks holding their experts and the combine sends them back, forward and again for the
  gradients: 4 all-to-alls (6 when the layer is recomputed), each moving (EP-1)/EP of its
  bytes over NVLink when the expert group (et x EP consecutive ranks) fits in a node, else
  across nodes, and paying the collective latency once per peer. The experts' gradients are
  reduced over the expert-data-parallel group (world / (et x EP x PP) ranks, strided by
  et x EP), the rest over DP x CP.
Left out: the embedding and output layer's small collectives and the optimizer step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

from launcher_scripts.costmodel.memory import (
    bytes_per_parameter,
    stage_expert_parameters,
    stage_layers,
    stage_parameters,
)
from launcher_scripts.errors import ConfigError
from launcher_scripts.recipes.layout import Layout
from launcher_scripts.recipes.model_shape import ModelShape

GB = 1e9  # bandwidths are GB/s
FRACTIONS = ("compute_efficiency", "dp_overlap")
MAY_BE_ZERO = ("dp_overlap", "collective_latency_us", "layer_overhead_us")


@dataclass(frozen=True)
class ClusterSpec:
    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0
    peak_tflops: float = 989.0  # dense bf16 per GPU (H100 SXM)
    compute_efficiency: float = 0.55  # fraction of peak the matmuls reach
    intra_node_gbps: float = 450.0  # GB/s per GPU, NVLink (one direction)
    inter_node_gbps: float = 50.0  # GB/s per GPU across nodes (e.g. 400 Gb/s IB)
    dp_overlap: float = 0.5  # fraction of the DP gradient reduction hidden under compute
    collective_latency_us: float = 10.0  # start-up of one step of a ring (NCCL on NVLink: ~10)
    layer_overhead_us: float = 0.0  # fixed time per layer and micro-batch, forward + backward

    @classmethod
    def from_settings(cls, settings: Mapping, prefix: str = "cluster") -> ClusterSpec:
        """Keys named as the fields; each error names `<prefix>.<key>`."""
        names = [field.name for field in fields(cls)]
        values: dict[str, float | int] = {}
        for name, value in settings.items():
            key = f"{prefix}.{name}"
            if name not in names:
                raise ConfigError(
                    key, "is not a cluster setting", f"Use one of: {', '.join(names)}"
                )
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(key, f"{value!r} is not a number", "Give a number")
            if value < 0 or (value == 0 and name not in MAY_BE_ZERO):
                raise ConfigError(key, f"{value} is not positive", "Give a number above 0")
            if name == "gpus_per_node" and not isinstance(value, int):
                raise ConfigError(key, f"{value!r} is not an integer", "Give a whole number")
            if name in FRACTIONS and value > 1:
                raise ConfigError(key, f"{value} is above 1", "Give a fraction of at most 1")
            values[name] = value
        return cls(**values)  # type: ignore[arg-type]


# Presets a user can name with `cluster=<name>`; "h100" is the default above.
CLUSTERS = {
    "h100": ClusterSpec(),
    "a100": ClusterSpec(peak_tflops=312.0, intra_node_gbps=300.0, inter_node_gbps=25.0),
}


@dataclass(frozen=True)
class StepPrediction:
    model_flops_per_step: float
    compute_s: float
    tp_comm_s: float
    pp_bubble_s: float
    dp_comm_s: float  # the whole gradient reduction; (1 - dp_overlap) of it is exposed
    step_time_s: float
    tflops_per_gpu: float  # model FLOPs per second and GPU
    cp_comm_s: float = 0.0
    dp_exposed_s: float = 0.0
    hardware_flops_per_step: float = 0.0
    overhead_s: float = 0.0  # the fixed per-layer cost, busiest stage, all micro-batches
    pp_comm_s: float = 0.0
    ep_comm_s: float = 0.0  # the expert-parallel all-to-alls, busiest stage

    def to_json(self) -> dict:
        return asdict(self)


def mlp_forward_flops(shape: ModelShape, moe: bool = False, padded: bool = False) -> float:
    """Forward FLOPs of one token's MLP (2 FLOPs a multiply-add): a dense layer's, or a MoE
    layer's routed experts (top-k; with `padded`, times the capacity factor), shared expert
    and router."""
    h, gated = shape.hidden_size, 2 if shape.gated_mlp else 1
    if not moe:
        return 2 * h * (shape.fc1_size + shape.ffn_hidden_size)
    experts = shape.experts
    assert experts is not None
    copies = experts.top_k * ((experts.capacity_factor or 1.0) if padded else 1.0)
    flops = copies * 2 * h * (gated + 1) * experts.ffn_hidden_size + 2 * h * experts.count
    if experts.shared_ffn_hidden_size:
        flops += 2 * h * (gated + 1) * experts.shared_ffn_hidden_size
    return flops


def layer_forward_flops(shape: ModelShape, moe: bool = False, padded: bool = False) -> float:
    """One layer's forward FLOPs for one sequence (2 FLOPs a multiply-add)."""
    s, h = shape.seq_length, shape.hidden_size
    q, kv = shape.query_size, shape.kv_size
    attention = 2 * s * (h * (q + 2 * kv) + q * h)
    return attention + s * mlp_forward_flops(shape, moe, padded) + attention_score_flops(shape)


def stack_forward_flops(
    shape: ModelShape, layers: range | None = None, padded: bool = False
) -> float:
    """Forward FLOPs of the layers (all by default) for one sequence."""
    indices = range(shape.num_layers) if layers is None else layers
    dense = layer_forward_flops(shape, False)
    moe = layer_forward_flops(shape, True, padded) if shape.experts else dense
    return sum(moe if shape.is_moe_layer(i) else dense for i in indices)


def attention_score_flops(shape: ModelShape) -> float:
    """Forward FLOPs of Q K^T and of the scores times V, one sequence: 2 x 2 s^2 q."""
    return 4 * shape.seq_length**2 * shape.query_size


def logits_forward_flops(shape: ModelShape, padded_vocab: int) -> float:
    return 2 * shape.seq_length * shape.hidden_size * padded_vocab


def model_flops_per_sample(shape: ModelShape, padded_vocab: int) -> float:
    """Forward and backward (3 x forward) of one sequence, no recomputation."""
    forward = stack_forward_flops(shape)
    return 3 * (forward + logits_forward_flops(shape, padded_vocab))


def model_flops_per_step(shape: ModelShape, layout: Layout) -> float:
    """Megatron's model FLOPs of one step (global batch), vocabulary padded for the layout."""
    return layout.global_batch * model_flops_per_sample(shape, shape.padded_vocab(layout.tensor))


def recomputed_layer_fraction(shape: ModelShape, layout: Layout) -> float:
    """Share of layers whose forward full recompute runs twice (the block method: the first
    recompute_num_layers of each model chunk)."""
    if layout.recompute != "full":
        return 0.0
    if layout.recompute_method != "block":
        return 1.0
    per_chunk = shape.num_layers // (layout.pipeline * (layout.virtual_pipeline or 1))
    return min(layout.recompute_num_layers, per_chunk) / per_chunk


def recompute_flops(shape: ModelShape, layout: Layout, layers: range | None = None) -> float:
    """Hardware FLOPs recomputation adds to the layers (all by default), one sequence."""
    indices = range(shape.num_layers) if layers is None else layers
    if layout.recompute == "selective":
        return len(indices) * attention_score_flops(shape)
    fraction = recomputed_layer_fraction(shape, layout)
    return fraction * stack_forward_flops(shape, indices, padded=True) if fraction else 0.0


def stage_hardware_flops(shape: ModelShape, layout: Layout, stage: str) -> float:
    """Hardware FLOPs of one sequence on the "only", "first" or "last" pipeline stage."""
    layers = stage_layers(shape, layout, stage)
    flops = 3 * stack_forward_flops(shape, layers, padded=True)
    flops += recompute_flops(shape, layout, layers)
    if stage in ("only", "last"):
        flops += 3 * logits_forward_flops(shape, shape.padded_vocab(layout.tensor))
    return flops


def ring_seconds(volume_bytes: float, ranks: int, gbps: float, latency_s: float = 0.0) -> float:
    """A ring all-gather or reduce-scatter: n-1 steps, each paying the collective latency,
    that move (n-1)/n of the bytes through each link."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * latency_s + (ranks - 1) / ranks * volume_bytes / (gbps * GB)


def predict_step(shape: ModelShape, layout: Layout, cluster: ClusterSpec) -> StepPrediction:
    """The predicted step time and its parts (see the module docstring)."""
    t, p, cp = layout.tensor, layout.pipeline, layout.context
    m, b, e = layout.micro_batches, layout.micro_batch, layout.element_bytes
    node = layout.gpus_per_node
    latency = cluster.collective_latency_us * 1e-6
    stages = ("only",) if p == 1 else ("first", "last")
    stage_flops = max(stage_hardware_flops(shape, layout, stage) for stage in stages)
    rate = cluster.peak_tflops * 1e12 * cluster.compute_efficiency
    compute = m * b * stage_flops / (t * cp) / rate

    layers = shape.num_layers // p
    local_seq = shape.seq_length / cp
    tp_bytes = e * local_seq * b * shape.hidden_size
    collectives = 4 + 2 * recomputed_layer_fraction(shape, layout)
    tp_gbps = cluster.intra_node_gbps if t <= node else cluster.inter_node_gbps
    # An all-reduce is a reduce-scatter plus an all-gather: 2 (t-1)/t of the bytes.
    tp_comm = m * layers * collectives * 2 * ring_seconds(tp_bytes, t, tp_gbps, latency)

    kv_bytes = 2 * e * local_seq * b * shape.kv_size / t
    cp_gbps = cluster.intra_node_gbps if t * cp <= node else cluster.inter_node_gbps
    hops = cp - 1
    cp_comm = m * layers * 3 * hops * (latency + kv_bytes / (cp_gbps * GB))

    v = layout.virtual_pipeline or 1
    overhead = m * layers * cluster.layer_overhead_us * 1e-6
    bubble = (p - 1) / (m * v) * (compute + overhead + tp_comm + cp_comm)
    p2p_bytes = tp_bytes / t if layout.sequence_parallel else tp_bytes
    pp_gbps = cluster.intra_node_gbps if layout.world_size <= node else cluster.inter_node_gbps
    pp_comm = 0.0 if p == 1 else m * v * 2 * (latency + p2p_bytes / (pp_gbps * GB))

    ep_comm = max(expert_dispatch_seconds(shape, layout, cluster, stage) for stage in stages)
    bubble += (p - 1) / (m * v) * ep_comm

    dp_comm = max(
        dp_reduction_seconds(
            stage_parameters(shape, layout, stage) - stage_expert_parameters(shape, layout, stage),
            layout,
            cluster,
        )
        + expert_reduction_seconds(stage_expert_parameters(shape, layout, stage), layout, cluster)
        for stage in stages
    )
    dp_exposed = (1 - cluster.dp_overlap) * dp_comm

    step = compute + overhead + tp_comm + cp_comm + ep_comm + bubble + pp_comm + dp_exposed
    model_flops = model_flops_per_step(shape, layout)
    return StepPrediction(
        model_flops_per_step=model_flops,
        compute_s=compute,
        tp_comm_s=tp_comm,
        pp_bubble_s=bubble,
        dp_comm_s=dp_comm,
        step_time_s=step,
        tflops_per_gpu=model_flops / step / layout.world_size / 1e12,
        cp_comm_s=cp_comm,
        dp_exposed_s=dp_exposed,
        hardware_flops_per_step=hardware_flops_per_step(shape, layout),
        overhead_s=overhead,
        pp_comm_s=pp_comm,
        ep_comm_s=ep_comm,
    )


def expert_dispatch_seconds(
    shape: ModelShape, layout: Layout, cluster: ClusterSpec, stage: str
) -> float:
    """The stage's all-to-alls over the expert-parallel group, all micro-batches (see the
    module docstring)."""
    if shape.experts is None or layout.expert == 1:
        return 0.0
    span = stage_layers(shape, layout, stage)
    moe = shape.moe_layers(span.start, len(span))
    ep, et = layout.expert, layout.expert_tensor_size
    copies = shape.experts.top_k * (shape.experts.capacity_factor or 1.0)
    tokens = copies * shape.seq_length / layout.context * layout.micro_batch * et / layout.tensor
    volume = layout.element_bytes * tokens * shape.hidden_size
    inside = et * ep <= layout.gpus_per_node
    gbps = cluster.intra_node_gbps if inside else cluster.inter_node_gbps
    latency = cluster.collective_latency_us * 1e-6
    one = (ep - 1) * latency + (ep - 1) / ep * volume / (gbps * GB)
    per_layer = 4 + 2 * recomputed_layer_fraction(shape, layout)
    return layout.micro_batches * moe * per_layer * one


def expert_reduction_seconds(params: float, layout: Layout, cluster: ClusterSpec) -> float:
    """The gradient reduction of one GPU's routed-expert parameters over the expert-data-
    parallel group (as dp_reduction_seconds does for the rest)."""
    ranks = layout.expert_data
    if not params or ranks <= 1:
        return 0.0
    # Ranks are ordered expert TP, EP, expert DP, PP: the group spans them all.
    span = layout.expert_tensor_size * layout.expert * ranks
    return _reduction_seconds(params, ranks, span, layout, cluster)


def dp_reduction_seconds(params: float, layout: Layout, cluster: ClusterSpec) -> float:
    """The gradient reduction of one GPU's `params` over the DP x CP group (see the module
    docstring), all of it: what dp_overlap hides is taken off by the caller."""
    reduce_ranks = layout.data * layout.context
    # Ranks are ordered TP, CP, DP, PP: the group spans TP x CP x DP consecutive GPUs.
    span = layout.tensor * reduce_ranks
    return _reduction_seconds(params, reduce_ranks, span, layout, cluster)


def _reduction_seconds(
    params: float, ranks: int, span: int, layout: Layout, cluster: ClusterSpec
) -> float:
    """Reduce-scatter and all-gather (distributed optimizer) or all-reduce of `params`'
    gradients over `ranks` ranks spread over `span` consecutive GPUs."""
    per_param = bytes_per_parameter(
        layout.dtype, layout.distributed_optimizer, ranks, layout.fp32_grads
    )
    gbps = cluster.inter_node_gbps if span > layout.gpus_per_node else cluster.intra_node_gbps
    latency = cluster.collective_latency_us * 1e-6
    grads = ring_seconds(params * per_param.gradients, ranks, gbps, latency)
    if layout.distributed_optimizer:
        return grads + ring_seconds(params * per_param.weights, ranks, gbps, latency)
    return 2 * grads


def hardware_flops_per_step(shape: ModelShape, layout: Layout) -> float:
    """Model FLOPs plus what recomputation runs again, for the whole step."""
    padding = stack_forward_flops(shape, padded=True) - stack_forward_flops(shape)
    extra = 3 * padding + recompute_flops(shape, layout)
    return model_flops_per_step(shape, layout) + layout.global_batch * extra
