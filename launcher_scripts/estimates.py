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
# Every gated activation megatron names (the encoder models' recipes use the GeGLU ones).
GATED_ALL = (*GATED, "geglu", "fast-geglu", "reglu", "fast-reglu")
HALF_PRECISIONS = ("16", "bf16", "16-mixed", "bf16-mixed")


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
    gated = 1.5 if model.get("activation", "gelu") in GATED_ALL else 1.0
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
    fc1 = ffn * (2 if str(model.get("activation", "gelu")) in GATED_ALL else 1)
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
    seq = int(model.encoder_seq_length) // context
    per_layer = activation_bytes_per_layer(model, seq, micro_batch, tensor, sequence_parallel)
    in_flight = min(pipeline, micro_batches)
    layers_held = int(model.num_layers) / pipeline * in_flight
    if virtual_pipeline:
        layers_held *= 1 + (pipeline - 1) / (pipeline * virtual_pipeline)
    return with_state(params, precision, distributed_optimizer, data, per_layer * layers_held)


def with_state(
    params: Parameters, precision: str, distributed_optimizer: bool, data: int, activations: float
) -> Memory:
    """Weights, gradients and optimizer state of `params.per_gpu` parameters, plus the
    activations (given for 16-bit; doubled for fp32)."""
    half = precision in HALF_PRECISIONS
    weight_bytes, optimizer_bytes = (2, 12) if half else (4, 8)
    return Memory(
        weights=params.per_gpu * weight_bytes,
        gradients=params.per_gpu * 4,
        optimizer=params.per_gpu * optimizer_bytes / (data if distributed_optimizer else 1),
        activations=activations * (1 if half else 2),
    )


# ----- encoder-decoder (T5) models ---------------------------------------------------------
# The encoder and decoder are `model.encoder` / `model.decoder` blocks with GPT's layer keys;
# decoder layers add cross-attention (queries from the decoder, keys and values from the
# encoder's output). One embedding table serves both and the output layer (tied), and the LM
# head has a bias. With pipeline parallelism the encoder runs on the `encoder_stages` first
# stages and the decoder on the `decoder_stages` after them; each side's first stage holds the
# embeddings.


def cross_attention_parameters(block: Any) -> int:
    hidden, heads = int(block.hidden_size), int(block.num_attention_heads)
    inner = int(block.get("kv_channels") or hidden // heads) * heads
    bias = bool(block.get("bias", True))
    return 4 * hidden * inner + (3 * inner + hidden if bias else 0) + norm_parameters(block)


def encoder_decoder_parameters(
    model: Any, padded_vocab: int, tensor: int, pipeline: int, encoder_stages: int
) -> Parameters:
    encoder, decoder = model.encoder, model.decoder
    hidden = int(encoder.hidden_size)
    words = padded_vocab * hidden
    learned = str(encoder.get("position_embedding_type", "learned_absolute")) == "learned_absolute"
    embeddings = words + (int(model.max_position_embeddings) * hidden if learned else 0)
    encoder_layer = layer_parameters(encoder)
    decoder_layer = layer_parameters(decoder) + cross_attention_parameters(decoder)
    head = padded_vocab + norm_parameters(decoder)  # LM-head bias and the decoder's final norm
    encoder_stack = int(encoder.num_layers) * encoder_layer + norm_parameters(encoder)
    total = embeddings + encoder_stack + int(decoder.num_layers) * decoder_layer + head
    if pipeline == 1:
        largest = total
    else:
        decoder_stages = pipeline - encoder_stages
        encoder_stage = embeddings + int(encoder.num_layers) // encoder_stages * encoder_layer
        decoder_stage = embeddings + int(decoder.num_layers) // decoder_stages * decoder_layer
        largest = max(encoder_stage, decoder_stage + head)
    return Parameters(total, -(-largest // tensor))


def encoder_decoder_flops_per_sample(
    model: Any, encoder_seq: int, decoder_seq: int, padded_vocab: int
) -> float:
    """Model FLOPs of one sample, forward and backward (3 x the forward's 2 FLOPs per
    multiply-add), counted matmul by matmul as Megatron's GPT formula is (which it equals for
    a decoder-only stack)."""

    def stack(block: Any, seq: int, memory_seq: int | None) -> float:
        hidden, heads = int(block.hidden_size), int(block.num_attention_heads)
        groups = int(block.get("num_query_groups") or heads)
        inner = int(block.get("kv_channels") or hidden // heads) * heads
        ffn = int(block.ffn_hidden_size)
        fc1 = ffn * (2 if str(block.get("activation", "gelu")) in GATED_ALL else 1)
        projections = hidden * inner * (1 + 2 * groups / heads) + inner * hidden
        per_layer = seq * (2 * (projections + hidden * fc1 + ffn * hidden) + 4 * seq * inner)
        if memory_seq is not None:  # cross-attention
            per_layer += 2 * 2 * hidden * inner * (seq + memory_seq) + 4 * seq * memory_seq * inner
        return int(block.num_layers) * per_layer

    forward = stack(model.encoder, encoder_seq, None) + stack(
        model.decoder, decoder_seq, encoder_seq
    )
    forward += 2 * decoder_seq * int(model.decoder.hidden_size) * padded_vocab
    return 3 * forward


def cross_attention_bytes(
    block: Any, seq: int, memory_seq: int, micro_batch: int, tensor: int, sequence_parallel: bool
) -> float:
    """What a cross-attention block keeps for backward, derived as Table 2 of Korthikanti et
    al. derives self-attention's: queries, keys, values and the projection input (2 bytes per
    element, split by TP), the q-length x kv-length scores, softmax and dropout (5*a*s*s_kv*b,
    split by TP, gone under selective recompute), and the norm input, query-projection input
    and dropout mask (5*s*b*h, split only under sequence parallelism)."""
    if block.get("activations_checkpoint_granularity") == "full":
        return 0.0  # only the layer input is kept, counted with the layer
    hidden, heads = int(block.hidden_size), int(block.num_attention_heads)
    b = micro_batch
    split = (4 * seq + 4 * memory_seq) * b * hidden
    if block.get("activations_checkpoint_granularity") != "selective":
        split += 5 * heads * seq * memory_seq * b
    replicated = 5 * seq * b * hidden
    return split / tensor + replicated / (tensor if sequence_parallel else 1)


def encoder_decoder_activations(
    model: Any,
    encoder_seq: int,
    decoder_seq: int,
    *,
    tensor: int,
    sequence_parallel: bool,
    micro_batch: int,
    micro_batches: int,
    pipeline: int,
    encoder_stages: int,
) -> float:
    """Bytes of activations on the busiest pipeline stage. Without pipelining the one stage holds
    every layer for one micro-batch; with it, the first encoder stage keeps min(PP, m)
    micro-batches in flight (1F1B) and the first decoder stage min(decoder stages, m)."""
    encoder, decoder = model.encoder, model.decoder
    args = (micro_batch, tensor, sequence_parallel)
    encoder_layer = activation_bytes_per_layer(encoder, encoder_seq, *args)
    decoder_layer = activation_bytes_per_layer(decoder, decoder_seq, *args)
    decoder_layer += cross_attention_bytes(decoder, decoder_seq, encoder_seq, *args)
    if pipeline == 1:
        return int(encoder.num_layers) * encoder_layer + int(decoder.num_layers) * decoder_layer
    decoder_stages = pipeline - encoder_stages
    encoder_layers = int(encoder.num_layers) / encoder_stages
    decoder_layers = int(decoder.num_layers) / decoder_stages
    encoder_side = encoder_layers * encoder_layer * min(pipeline, micro_batches)
    decoder_side = decoder_layers * decoder_layer * min(decoder_stages, micro_batches)
    return max(encoder_side, decoder_side)
