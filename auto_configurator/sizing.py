"""Model-size recommendation, the architecture of a given size, and the time to train.

The recommendation inverts the training compute of a dense transformer, C = 6 N D model FLOPs
for N parameters and D tokens (forward 2 N D, backward 4 N D; Kaplan et al. 2020, "Scaling
Laws for Neural Language Models", section 2.1; attention's share is left out because the
architecture is not known yet). The time to train a base config uses the architecture's own
model FLOPs per step (costmodel.throughput.model_flops_per_step, which counts attention
and the logits too) when the model is a decoder or encoder stack.

The architecture rule: hidden size, heads and learning rate come from a table by model size
(the GPT-3 paper's shapes, Brown et al. 2020, table 2.1, and the NeMo launcher's published sizes);
the number of layers is then solved from the parameter count and rounded (to a multiple of 4
from 16 layers up, so more pipeline sizes divide it). FFN = 4 x hidden (GPT, BERT).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SECONDS_PER_DAY = 86400
TRAINING_FLOPS_PER_PARAMETER_TOKEN = 6  # forward 2 + backward 4 (Kaplan et al. 2020)


@dataclass(frozen=True)
class SizeRow:
    up_to_b: float  # this row applies to models up to this many billion parameters
    hidden: int
    heads: int
    lr: float


# Decoder and encoder stacks (GPT, BERT). The last rows extrapolate at 128 channels a head.
STACK_TABLE = (
    SizeRow(0.01, 128, 4, 1.0e-3),  # test-sized models (CPU)
    SizeRow(0.1, 512, 8, 6.0e-4),
    SizeRow(0.25, 768, 12, 6.0e-4),
    SizeRow(0.5, 1024, 16, 3.0e-4),
    SizeRow(1.0, 1536, 16, 2.5e-4),
    SizeRow(2.0, 2048, 16, 2.0e-4),
    SizeRow(3.0, 2560, 32, 1.6e-4),
    SizeRow(4.5, 3072, 32, 1.4e-4),
    SizeRow(8.0, 4096, 32, 1.2e-4),
    SizeRow(13.0, 5120, 40, 1.0e-4),
    SizeRow(25.0, 6144, 48, 1.0e-4),
    SizeRow(60.0, 8192, 64, 0.8e-4),
    SizeRow(120.0, 10240, 80, 0.7e-4),
    SizeRow(250.0, 12288, 96, 0.6e-4),
    SizeRow(math.inf, 16384, 128, 0.5e-4),
)

# T5 and mT5 (the NeMo launcher's published T5 shapes): hidden, heads and a gated FFN width.
ENCODER_DECODER_TABLE = (
    (SizeRow(0.01, 128, 4, 1.0e-3), 256),  # test-sized models (CPU)
    (SizeRow(0.5, 768, 12, 1.0e-4), 2048),
    (SizeRow(5.0, 2048, 32, 1.0e-4), 5120),
    (SizeRow(15.0, 4096, 64, 1.0e-4), 10240),
    (SizeRow(30.0, 5120, 80, 0.8e-4), 10880),
    (SizeRow(math.inf, 6144, 96, 0.8e-4), 10880),
)
T5_KV_CHANNELS = 64


# (model size below this many billion parameters, sequences of 2048 tokens per batch)
BATCH_BY_SIZE = ((0.5, 256), (3.0, 512), (100.0, 1024), (math.inf, 1536))


@dataclass(frozen=True)
class Architecture:
    num_layers: int  # per stack: T5's encoder and decoder have this many each
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    lr: float
    parameters: int  # by the count this rule solves with

    @property
    def init_method_std(self) -> float:
        """sqrt(2 / (5 h)) ("small init", Nguyen and Salazar 2019): 0.023 at hidden 768."""
        return round(math.sqrt(2 / (5 * self.hidden_size)), 4)


def recommend_size_in_b(gpus: int, tflops_per_gpu: float, days: float, tokens_in_b: float) -> float:
    """The largest model (billions of parameters) that `gpus` GPUs at `tflops_per_gpu` model
    TFLOP/s train on `tokens_in_b` billion tokens in `days` days: N = C / (6 D)."""
    compute = gpus * tflops_per_gpu * 1e12 * days * SECONDS_PER_DAY
    return compute / (TRAINING_FLOPS_PER_PARAMETER_TOKEN * tokens_in_b * 1e9) / 1e9


def days_to_train_6nd(size_in_b: float, tokens_in_b: float, gpus: int, tflops: float) -> float:
    """Days to train N parameters on D tokens at 6 N D FLOPs (no architecture needed)."""
    flops = TRAINING_FLOPS_PER_PARAMETER_TOKEN * size_in_b * 1e9 * tokens_in_b * 1e9
    return flops / (gpus * tflops * 1e12) / SECONDS_PER_DAY


def days_to_train(flops_per_step: float, steps: float, gpus: int, tflops: float) -> float:
    return flops_per_step * steps / (gpus * tflops * 1e12) / SECONDS_PER_DAY


def stack_parameters(layers: int, hidden: int, ffn: int, vocab: int, seq: int) -> int:
    """A GPT (or BERT) stack with biases, learned positions and tied embeddings: per layer
    QKV 3h^2+3h, projection h^2+h, FFN 2hf+f+h, two layer norms 4h; embeddings (V+s)h; the
    final layer norm 2h."""
    per_layer = 4 * hidden * hidden + 2 * hidden * ffn + ffn + 9 * hidden
    return layers * per_layer + (vocab + seq) * hidden + 2 * hidden


def encoder_decoder_parameters(layers: int, hidden: int, ffn: int, heads: int, vocab: int) -> int:
    """T5 with `layers` encoder and `layers` decoder layers, gated FFN (3hf), no biases,
    relative positions: self-attention 4ha, cross-attention 4ha (decoder), a = heads x 64."""
    attention = 4 * hidden * heads * T5_KV_CHANNELS
    gated_ffn = 3 * hidden * ffn
    encoder, decoder = attention + gated_ffn, 2 * attention + gated_ffn
    return layers * (encoder + decoder) + vocab * hidden


def _round_layers(exact: float) -> int:
    layers = max(1, round(exact))
    return max(4, 4 * round(exact / 4)) if layers >= 16 else layers


def stack_architecture(size_in_b: float, vocab: int, seq: int) -> Architecture:
    """GPT and BERT: hidden, heads and learning rate from STACK_TABLE, layers solved."""
    target = size_in_b * 1e9
    rows = [row for row in STACK_TABLE if size_in_b <= row.up_to_b]
    for row in [rows[0], *reversed(STACK_TABLE[: STACK_TABLE.index(rows[0])])]:
        hidden, ffn = row.hidden, 4 * row.hidden
        per_layer = stack_parameters(1, hidden, ffn, 0, 0) - 2 * hidden
        exact = (target - stack_parameters(0, hidden, ffn, vocab, seq)) / per_layer
        if exact >= 0.5 or row is STACK_TABLE[0]:
            layers = _round_layers(exact)
            count = stack_parameters(layers, hidden, ffn, vocab, seq)
            return Architecture(layers, hidden, ffn, row.heads, row.lr, count)
    raise AssertionError("unreachable: the first table row always returns")


def encoder_decoder_architecture(size_in_b: float, vocab: int) -> Architecture:
    """T5 and mT5: hidden, heads, FFN from ENCODER_DECODER_TABLE, layers per stack solved."""
    target = size_in_b * 1e9
    index = next(i for i, (row, _) in enumerate(ENCODER_DECODER_TABLE) if size_in_b <= row.up_to_b)
    for row, ffn in reversed(ENCODER_DECODER_TABLE[: index + 1]):
        per_layer = encoder_decoder_parameters(1, row.hidden, ffn, row.heads, 0)
        exact = (target - vocab * row.hidden) / per_layer
        if exact >= 0.5 or row is ENCODER_DECODER_TABLE[0][0]:
            layers = _round_layers(exact)
            count = encoder_decoder_parameters(layers, row.hidden, ffn, row.heads, vocab)
            return Architecture(layers, row.hidden, ffn, row.heads, row.lr, count)
    raise AssertionError("unreachable: the first table row always returns")


def global_batch_size(size_in_b: float, seq: int, gpus: int) -> int:
    """The GPT-3 paper's batch by model size: 256, 512, 1024 and 1536 sequences of 2048 tokens
    (0.5M, 1M, 2M and 3.2M tokens) up to 0.5B, 3B, 100B parameters and above; the same tokens
    per batch at other sequence lengths; then rounded to the nearest multiple of the GPUs, so
    that every layout's data-parallel size divides it."""
    sequences = next(n for limit, n in BATCH_BY_SIZE if size_in_b < limit) * 2048 / seq
    return max(1, round(sequences / gpus)) * gpus
