"""What a training recipe costs, from its numbers alone (no torch): parameters, memory per GPU,
model FLOPs. The dry-run plan prints these; training logs the same FLOPs count.

GPT and BERT stacks use the AutoConfigurator's analytical model (launcher_scripts.costmodel.shapes,
.memory, .throughput: Korthikanti et al. 2022 for activations, Megatron-Core's distributed
optimizer table for weights, gradients and optimizer state, Narayanan et al. 2021 for FLOPs;
their docstrings cite the formulas). This module adapts recipes to it and keeps what only the
encoder-decoder (T5, mT5) recipes need, built from the same per-layer pieces.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from launcher_scripts.costmodel import memory, throughput
from launcher_scripts.recipes import model_shape
from launcher_scripts.recipes.layout import Layout
from launcher_scripts.recipes.model_shape import ModelShape, read_shape

GB = 1e9


def padded_vocab(vocab: int, model: Any, tensor: int) -> int:
    """The vocabulary of a recipe's `model` section as Megatron pads it."""
    return model_shape.padded_vocab(
        vocab, int(model.get("make_vocab_size_divisible_by", 128)), tensor
    )


def model_flops_per_sample(model: Any, seq_length: int, padded_vocab: int) -> float:
    """Megatron's model FLOPs for one sequence of a GPT recipe's `model` section, forward and
    backward, no recompute (launcher_scripts.costmodel.throughput.model_flops_per_sample)."""
    shape = read_shape(model, vocab_size=padded_vocab, seq_length=seq_length)
    return throughput.model_flops_per_sample(shape, padded_vocab)


@dataclass(frozen=True)
class Parameters:
    total: int
    per_gpu: int  # the busiest pipeline stage's share on one GPU
    active: int | None = None  # a mixture of experts': those one token passes through


# ----- encoder-decoder (T5) models ---------------------------------------------------------
# The encoder and decoder are `model.encoder` / `model.decoder` blocks with GPT's layer keys;
# decoder layers add cross-attention (queries from the decoder, keys and values from the
# encoder's output). One embedding table serves both and the output layer (tied), and the LM
# head has a bias. With pipeline parallelism the encoder runs on the `encoder_stages` first
# stages and the whole decoder on the last (megatron-core hands one tensor between stages);
# the first stage and the decoder's each hold the embeddings.


def block_shape(block: Any, seq: int, vocab: int, max_positions: int | None = None) -> ModelShape:
    """An encoder or decoder block of a T5 recipe as the analytical model's stack shape."""
    shape = read_shape(block, vocab_size=vocab, seq_length=seq)
    return replace(shape, max_position_embeddings=max_positions)


def block_recompute(block: Any) -> str | None:
    """The recomputation a block's settings amount to. NeMo's T5 recipes say `full` with the
    `block` method over 0 layers: the first 0 layers of each stage are recomputed, i.e. none.
    A block method over N > 0 layers is counted as full recomputation of every layer (an
    under-estimate of the activations when N is below the stage's layers)."""
    granularity = block.get("activations_checkpoint_granularity")
    if (
        granularity == "full"
        and block.get("activations_checkpoint_method") == "block"
        and not block.get("activations_checkpoint_num_layers")
    ):
        return None
    return granularity


def block_layout(
    block: Any, micro_batch: int, tensor: int, sequence_parallel: bool, precision: str
) -> Layout:
    """The per-layer activation formulas' view of a T5 run (one GPU's share)."""
    return Layout(
        num_nodes=1,
        gpus_per_node=tensor,
        tensor=tensor,
        sequence_parallel=sequence_parallel,
        micro_batch=micro_batch,
        recompute=block_recompute(block),
        precision=precision,
    )


def average_layer_bytes(shape: ModelShape, layout: Layout) -> float:
    """memory.layer_activation_bytes of a block's layer, on average over its dense and MoE
    layers."""
    total = sum(
        memory.layer_activation_bytes(shape, layout, shape.is_moe_layer(i))
        for i in range(shape.num_layers)
    )
    return total / shape.num_layers


def cross_attention_parameters(block: Any) -> int:
    hidden, heads = int(block.hidden_size), int(block.num_attention_heads)
    inner = int(block.get("kv_channels") or hidden // heads) * heads
    bias = bool(block.get("bias", True))
    norm = hidden * (1 if str(block.get("normalization")) == "rmsnorm" else 2)
    return 4 * hidden * inner + (3 * inner + hidden if bias else 0) + norm


def encoder_decoder_parameters(
    model: Any, padded_vocab: int, tensor: int, pipeline: int, encoder_stages: int
) -> Parameters:
    encoder, decoder = model.encoder, model.decoder
    positions = int(model.max_position_embeddings)
    encoder_shape = block_shape(encoder, positions, padded_vocab, positions)
    decoder_shape = block_shape(decoder, positions, padded_vocab, positions)
    hidden = encoder_shape.hidden_size
    embeddings = padded_vocab * hidden + encoder_shape.position_parameters()
    # A layer of each, on average (a block's MoE layers counted with their experts).
    encoder_layer = encoder_shape.stack_parameters() // encoder_shape.num_layers
    decoder_layer = decoder_shape.stack_parameters() // decoder_shape.num_layers
    decoder_layer += cross_attention_parameters(decoder)
    head = padded_vocab + decoder_shape.norm_parameters()  # LM-head bias, the decoder's norm
    encoder_stack = encoder_shape.num_layers * encoder_layer + encoder_shape.norm_parameters()
    total = embeddings + encoder_stack + decoder_shape.num_layers * decoder_layer + head
    if pipeline == 1:
        largest = total
    else:
        # The first stage (embeddings; the encoder's final norm when it is the only encoder
        # stage) or the decoder's, the last (a copy of the embeddings, every decoder layer).
        encoder_stage = embeddings + encoder_shape.num_layers // encoder_stages * encoder_layer
        if encoder_stages == 1:
            encoder_stage += encoder_shape.norm_parameters()
        decoder_stage = embeddings + decoder_shape.num_layers * decoder_layer + head
        largest = max(encoder_stage, decoder_stage)
    return Parameters(total, -(-largest // tensor))


def cross_attention_inner(block: Any) -> int:
    """The width of cross-attention's queries, keys and values: heads x head dim."""
    hidden, heads = int(block.hidden_size), int(block.num_attention_heads)
    return int(block.get("kv_channels") or hidden // heads) * heads


def cross_attention_score_flops(block: Any, decoder_seq: int, encoder_seq: int) -> float:
    """Forward FLOPs of one layer's cross-attention scores and their product with V, one
    sample: decoder x encoder tokens."""
    return 4 * decoder_seq * encoder_seq * cross_attention_inner(block)


def cross_attention_forward_flops(block: Any, decoder_seq: int, encoder_seq: int) -> float:
    """Forward FLOPs of one decoder layer's cross-attention, one sample: the query and output
    projections over the decoder's tokens, key and value over the encoder's, and the scores."""
    projections = 2 * 2 * int(block.hidden_size) * cross_attention_inner(block)
    projections *= decoder_seq + encoder_seq
    return projections + cross_attention_score_flops(block, decoder_seq, encoder_seq)


def encoder_decoder_flops_per_sample(
    model: Any, encoder_seq: int, decoder_seq: int, padded_vocab: int
) -> float:
    """Model FLOPs of one sample, forward and backward (3 x the forward), counted matmul by
    matmul as the GPT count is: the encoder's and decoder's self-attention layers
    (costmodel.throughput.layer_forward_flops), the decoder's cross-attention and the
    LM head."""

    def stack(block: Any, seq: int) -> float:
        shape = block_shape(block, seq, padded_vocab)
        return throughput.stack_forward_flops(shape)

    def cross_attention(block: Any) -> float:
        per_layer = cross_attention_forward_flops(block, decoder_seq, encoder_seq)
        return int(block.num_layers) * per_layer

    forward = stack(model.encoder, encoder_seq) + stack(model.decoder, decoder_seq)
    forward += cross_attention(model.decoder)
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
    recompute = block_recompute(block)
    if recompute == "full":
        return 0.0  # only the layer input is kept, counted with the layer
    hidden, heads = int(block.hidden_size), int(block.num_attention_heads)
    b = micro_batch
    split = (4 * seq + 4 * memory_seq) * b * hidden
    if recompute != "selective":
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
    padded_vocab: int,
    precision: str = "bf16",
) -> tuple[float, float]:
    """Bytes of activations on the busiest pipeline stage: (the layers', the rest).

    Per layer, launcher_scripts.costmodel.memory.layer_activation_bytes (Korthikanti et al. Table 2)
    plus cross-attention in the decoder. The rest, per micro-batch ([K] section 4.3): each
    embedding's dropout mask, the encoder's output kept twice (its final norm's input, and the
    input of every cross-attention's key/value projection) and the LM head's terms. Without
    pipelining one stage holds it all for one micro-batch. With it the encoder runs on the
    first stages and the decoder on the last: the first stage keeps min(PP, m) micro-batches in
    flight (1F1B) with their embeddings (and the final norm's input when it is the only encoder
    stage); the last keeps one micro-batch of the decoder, its embedding, the received encoder
    output and the LM head."""
    encoder, decoder = model.encoder, model.decoder
    args = (micro_batch, tensor, sequence_parallel)
    encoder_shape = block_shape(encoder, encoder_seq, padded_vocab)
    decoder_shape = block_shape(decoder, decoder_seq, padded_vocab)
    encoder_layout = block_layout(encoder, *args, precision)
    encoder_layer = average_layer_bytes(encoder_shape, encoder_layout)
    decoder_layout = block_layout(decoder, *args, precision)
    decoder_layer = average_layer_bytes(decoder_shape, decoder_layout)
    decoder_layer += cross_attention_bytes(decoder, decoder_seq, encoder_seq, *args)
    encoder_embedding = memory.embedding_activation_bytes(encoder_shape, encoder_layout)
    decoder_embedding = memory.embedding_activation_bytes(decoder_shape, decoder_layout)
    sequence_split = tensor if sequence_parallel else 1
    hidden = encoder_shape.hidden_size
    encoder_output = encoder_layout.element_bytes * encoder_seq * micro_batch * hidden
    encoder_output /= sequence_split
    head = memory.output_activation_bytes(decoder_shape, decoder_layout)
    decoder_layers = decoder_shape.num_layers * decoder_layer
    decoder_other = decoder_embedding + encoder_output + head
    if pipeline == 1:
        layers = encoder_shape.num_layers * encoder_layer + decoder_layers
        return layers, encoder_embedding + encoder_output + decoder_other
    in_flight = min(pipeline, micro_batches)
    encoder_layers = encoder_shape.num_layers // encoder_stages * encoder_layer * in_flight
    final_norm = encoder_output if encoder_stages == 1 else 0.0
    encoder_other = (encoder_embedding + final_norm) * in_flight
    if decoder_layers + decoder_other >= encoder_layers + encoder_other:
        return decoder_layers, decoder_other
    return encoder_layers, encoder_other
