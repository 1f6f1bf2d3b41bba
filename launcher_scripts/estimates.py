"""What a GPT training recipe costs, from its numbers alone (no torch): parameters, memory per
GPU, model FLOPs. The dry-run plan prints these; training logs the same FLOPs count.

Memory per GPU is the sum of
  * weights, gradients and optimizer state, per parameter held by the GPU (the largest pipeline
    stage, its tensor-parallel share): with bf16/fp16, 2 bytes of weight, 4 of fp32 gradient
    (megatron-core accumulates in fp32) and 12 of optimizer state (fp32 master copy and Adam's two
    moments), the last divided by the data-parallel size under the distributed optimizer; with
    fp32, 4 + 4 + 8 (no master copy);
  * activations, after Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", Table 2: bytes per layer and micro-batch of s*b*h*(34 + 5*a*s/h) with no
    parallelism, s*b*h*(10 + 24/t + 5*a*s/(h*t)) with tensor parallelism t,
    s*b*h/t*(34 + 5*a*s/h) with sequence parallelism too, the 5*a*s/h term gone under selective
    recomputation, and 2*s*b*h (the layer input, /t with sequence parallelism) under full
    recomputation. The first pipeline stage holds the most: L/p layers for each of the p
    micro-batches in flight (fewer when a step has fewer), times 1 + (p-1)/(p*v) with v virtual
    stages (section 4.2.3). Context parallelism divides s. The paper's figures are for 16-bit
    activations; fp32 doubles them.
Estimates leave out what no formula holds (framework buffers, fragmentation, NCCL): plan on
headroom.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GB = 1e9
GATED = ("swiglu", "fast-swiglu")


def padded_vocab(vocab: int, model: Any, tensor: int) -> int:
    """Megatron pads the vocabulary so every TP rank holds an equal, aligned slice."""
    multiple = int(model.get("make_vocab_size_divisible_by", 128)) * tensor
    return -(-vocab // multiple) * multiple


def model_flops_per_sample(model: Any, seq_length: int, padded_vocab: int) -> float:
    """Megatron's model-FLOPs count for one sequence, forward and backward, no recompute.

    12 * s * L * h^2 * (attention + MLP + logits), where attention counts the QKV and output
    projections (with grouped queries) and the score/context products, MLP the two (or, gated,
    three) FFN matrices, and logits the output layer.
    """
    hidden, layers = model.hidden_size, model.num_layers
    heads = model.num_attention_heads
    groups = model.get("num_query_groups") or heads
    kv_channels = model.get("kv_channels") or hidden // heads
    gated = 1.5 if model.activation in GATED else 1.0
    attention = (1 + groups / heads + seq_length / hidden) * (kv_channels * heads / hidden)
    mlp = model.ffn_hidden_size / hidden * gated
    logits = padded_vocab / (2 * layers * hidden)
    return 12.0 * seq_length * layers * hidden * hidden * (attention + mlp + logits)


def layer_parameters(model: Any) -> int:
    hidden, ffn = int(model.hidden_size), int(model.ffn_hidden_size)
    heads = int(model.num_attention_heads)
    groups = int(model.get("num_query_groups") or heads)
    channels = int(model.get("kv_channels") or hidden // heads)
    bias = bool(model.get("bias", True))
    qkv = channels * (heads + 2 * groups)
    attention = hidden * qkv + channels * heads * hidden + (qkv + hidden if bias else 0)
    fc1 = ffn * (2 if str(model.get("activation", "gelu")) in GATED else 1)
    mlp = hidden * fc1 + ffn * hidden + (fc1 + hidden if bias else 0)
    return attention + mlp + 2 * norm_parameters(model)


def norm_parameters(model: Any) -> int:
    hidden = int(model.hidden_size)
    return hidden if str(model.get("normalization", "layernorm")) == "rmsnorm" else 2 * hidden


@dataclass(frozen=True)
class Parameters:
    total: int
    per_gpu: int  # the largest pipeline stage's share on one tensor-parallel rank


def parameters(model: Any, padded_vocab: int, tensor: int, pipeline: int) -> Parameters:
    hidden, layers = int(model.hidden_size), int(model.num_layers)
    words = padded_vocab * hidden
    positions = (
        int(model.max_position_embeddings) * hidden
        if str(model.get("position_embedding_type", "learned_absolute")) == "learned_absolute"
        else 0
    )
    tied = bool(model.get("share_embeddings_and_output_weights", True))
    stack = layers * layer_parameters(model)
    total = words + positions + stack + norm_parameters(model) + (0 if tied else words)
    stage_layers = layers // pipeline * layer_parameters(model)
    if pipeline == 1:
        largest = total
    else:
        first = words + positions + stage_layers
        # With tied embeddings the last stage keeps its own copy of the word embeddings.
        last = stage_layers + norm_parameters(model) + words
        largest = max(first, last)
    return Parameters(total, -(-largest // tensor))


@dataclass(frozen=True)
class Memory:
    weights: float  # bytes per GPU
    gradients: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations


def activation_bytes_per_layer(
    model: Any, seq: int, micro_batch: int, tensor: int, sequence_parallel: bool
) -> float:
    """Korthikanti et al. 2022, Table 2 (16-bit activations)."""
    hidden, heads = int(model.hidden_size), int(model.num_attention_heads)
    granularity = model.get("activations_checkpoint_granularity")
    sbh = seq * micro_batch * hidden
    if granularity == "full":
        return 2 * sbh / (tensor if sequence_parallel else 1)
    attention = 0.0 if granularity == "selective" else 5 * heads * seq / hidden
    if sequence_parallel:
        return sbh / tensor * (34 + attention)
    return sbh * (10 + 24 / tensor + attention / tensor)


def memory_per_gpu(
    model: Any,
    params: Parameters,
    *,
    precision: str,
    distributed_optimizer: bool,
    tensor: int,
    pipeline: int,
    virtual_pipeline: int | None,
    context: int,
    data: int,
    sequence_parallel: bool,
    micro_batch: int,
    micro_batches: int,
) -> Memory:
    half = precision in ("16", "bf16", "16-mixed", "bf16-mixed")
    weight_bytes, optimizer_bytes = (2, 12) if half else (4, 8)
    optimizer = params.per_gpu * optimizer_bytes / (data if distributed_optimizer else 1)
    seq = int(model.encoder_seq_length) // context
    per_layer = activation_bytes_per_layer(model, seq, micro_batch, tensor, sequence_parallel)
    in_flight = min(pipeline, micro_batches)
    layers_held = int(model.num_layers) / pipeline * in_flight
    if virtual_pipeline:
        layers_held *= 1 + (pipeline - 1) / (pipeline * virtual_pipeline)
    activations = per_layer * layers_held * (1 if half else 2)
    return Memory(
        weights=params.per_gpu * weight_bytes,
        gradients=params.per_gpu * 4,
        optimizer=optimizer,
        activations=activations,
    )
