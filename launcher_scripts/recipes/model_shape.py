"""What a model is, in numbers: the one torch-free description of a transformer stack that every
reader takes (the plan and the AutoConfigurator's cost model, the portable file's tensor-shape
checks, the megatron-core model the job builds, continued pretraining's architecture check).

`ModelShape` is a decoder-only (GPT) or encoder-only (BERT) stack, or one block of an
encoder-decoder (T5); `Experts` is its mixture-of-experts MLP where it has one (megatron-core's
MoELayer: routed experts, an optional shared expert, top-k routing and its losses). A family
reads its recipes' `model` sections into these (`ModelFamily.shape`); `read_shape` is the
reader every family's uses for a stack. Errors name the recipe key.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher_scripts.errors import ConfigError
from launcher_scripts.formats.portable_check import GATED_ACTIVATIONS

GPT2_VOCAB = 50257  # assumed when the tokenizer cannot be read
# Other tokenizers' usual sizes, assumed likewise: BERT's uncased and cased WordPiece.
ASSUMED_VOCAB = {"BertWordPieceLowerCase": 30522, "BertWordPieceCase": 28996}
# megatron-core's router balancing: a global auxiliary loss (Switch/GShard), a per-sequence
# one (DeepSeek-V2), Sinkhorn assignment (no loss), or none.
BALANCING = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")
DISPATCHERS = ("alltoall", "allgather")
# The recipe keys of the experts (megatron-core's TransformerConfig names, as NeMo's recipes
# write them).
EXPERT_KEYS = (
    "num_moe_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_layer_freq",
    "moe_router_pre_softmax",
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    "moe_expert_capacity_factor",
    "moe_token_dispatcher_type",
    "moe_grouped_gemm",
)
# Of those, the ones a trained model's weights depend on (continued pretraining and the
# portable file check them); the rest are how it trains.
EXPERT_ARCHITECTURE_KEYS = EXPERT_KEYS[:7]


def padded_vocab(vocab_size: int, divisible_by: int, tensor: int) -> int:
    """Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by x TP so that
    every tensor-parallel rank holds an equal, aligned slice of the table."""
    multiple = divisible_by * tensor
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts MLP (megatron-core's MoELayer) in place of the dense one."""

    count: int  # routed experts (num_moe_experts)
    top_k: int  # experts each token is routed to
    ffn_hidden_size: int  # each routed expert's MLP width
    shared_ffn_hidden_size: int = 0  # the shared expert's width (Qwen2-MoE, DeepSeek); 0: none
    shared_gate: bool = False  # a sigmoid gate on the shared expert's output (Qwen2-MoE)
    # Which layers are MoE: every n-th (an int, megatron's layer i when i % n == 0) or a 0/1
    # pattern with one entry per layer.
    layer_freq: int | tuple[int, ...] = 1
    pre_softmax: bool = False  # softmax over all experts before the top-k (Qwen2-MoE)
    balancing: str = "aux_loss"
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float | None = None
    capacity_factor: float | None = None  # None: dropless; else tokens beyond it are dropped
    dispatcher: str = "alltoall"
    grouped_gemm: bool = False

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` (0-based, over the whole stack) has the experts."""
        if isinstance(self.layer_freq, int):
            return index % self.layer_freq == 0
        return bool(self.layer_freq[index])

    @property
    def pattern(self) -> int | list[int]:
        """moe_layer_freq as megatron-core takes it."""
        return self.layer_freq if isinstance(self.layer_freq, int) else list(self.layer_freq)


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only (GPT) or encoder (BERT) transformer stack."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int  # unpadded; padded_vocab() pads it as Megatron does
    num_query_groups: int | None = None  # None: = heads
    kv_channels: int | None = None  # None: hidden / heads
    gated_mlp: bool = False  # swiglu/geglu: fc1 is 2 x ffn
    bias: bool = True
    tied_embeddings: bool = True
    learned_positions: bool = True  # learned_absolute position embeddings
    max_position_embeddings: int | None = None
    make_vocab_size_divisible_by: int = 128
    rms_norm: bool = False  # RMSNorm has a scale only; LayerNorm a scale and a bias
    experts: Experts | None = None  # None: every layer's MLP is dense
    qkv_bias: bool = False  # biases on Q, K and V alone (Qwen2), without `bias`
    qk_layernorm: bool = False  # a norm over each head's query and key (Qwen3)

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_size(self) -> int:
        """Width of the queries (and of the attention output): heads x head dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the keys (and of the values): query groups x head dim."""
        return self.query_groups * self.head_dim

    @property
    def fc1_size(self) -> int:
        return self.ffn_hidden_size * (2 if self.gated_mlp else 1)

    def padded_vocab(self, tensor: int = 1) -> int:
        return padded_vocab(self.vocab_size, self.make_vocab_size_divisible_by, tensor)

    def norm_parameters(self) -> int:
        return self.hidden_size * (1 if self.rms_norm else 2)

    def is_moe_layer(self, index: int) -> bool:
        return self.experts is not None and self.experts.is_moe_layer(index)

    def moe_layers(self, first: int = 0, count: int | None = None) -> int:
        """How many of the layers first .. first + count - 1 (all by default) are MoE."""
        count = self.num_layers - first if count is None else count
        return sum(self.is_moe_layer(i) for i in range(first, first + count))

    def attention_parameters_split(self) -> tuple[int, int]:
        """The attention block and the layer's two norms as (split by TP, replicated).

        Column-parallel layers (QKV) split their weights and biases; row-parallel layers (the
        output projection) split their weights but every rank keeps the whole bias; the norms
        are replicated (megatron-core's ColumnParallelLinear / RowParallelLinear).
        """
        h, qkv = self.hidden_size, self.query_size + 2 * self.kv_size
        split = h * qkv + self.query_size * h
        replicated = 2 * self.norm_parameters()
        if self.qk_layernorm:  # one per head's width, shared by the heads
            replicated += 2 * self.head_dim * (1 if self.rms_norm else 2)
        if self.bias or self.qkv_bias:
            split += qkv
        if self.bias:
            replicated += h
        return split, replicated

    def mlp_parameters_split(self, ffn: int) -> tuple[int, int]:
        """A dense MLP of width `ffn` as (split by its TP group, replicated): fc1 (x2 gated)
        and its bias split, fc2's weight split and its bias whole on every rank."""
        h, fc1 = self.hidden_size, ffn * (2 if self.gated_mlp else 1)
        split, replicated = h * fc1 + ffn * h, 0
        if self.bias:
            split += fc1
            replicated += h
        return split, replicated

    def layer_parameters_split(self) -> tuple[int, int]:
        """One dense layer's parameters as (split by TP, replicated on every TP rank)."""
        attention, attention_whole = self.attention_parameters_split()
        mlp, mlp_whole = self.mlp_parameters_split(self.ffn_hidden_size)
        return attention + mlp, attention_whole + mlp_whole

    def moe_layer_parameters_split(self) -> tuple[int, int, int, int]:
        """One MoE layer's parameters as (split by TP, replicated over TP, the routed experts'
        split by expert TP, their part whole on every expert-TP rank), all experts counted.
        The router (experts x hidden) and the shared expert's gate are replicated; the shared
        expert is a dense MLP split by TP (megatron-core's TopKRouter, SharedExpertMLP)."""
        experts = self.experts
        assert experts is not None
        split, replicated = self.attention_parameters_split()
        replicated += experts.count * self.hidden_size
        if experts.shared_ffn_hidden_size:
            shared, shared_whole = self.mlp_parameters_split(experts.shared_ffn_hidden_size)
            split += shared
            replicated += shared_whole + (self.hidden_size if experts.shared_gate else 0)
        expert, expert_whole = self.mlp_parameters_split(experts.ffn_hidden_size)
        return split, replicated, experts.count * expert, experts.count * expert_whole

    def layer_parameters(self, tensor: int = 1) -> int:
        """One dense layer's parameters on one tensor-parallel rank (tensor=1: the layer)."""
        split, replicated = self.layer_parameters_split()
        return -(-split // tensor) + replicated

    def moe_layer_parameters(
        self, tensor: int = 1, expert: int = 1, expert_tensor: int | None = None
    ) -> int:
        """One MoE layer's parameters on one rank: its share of the dense part over TP and of
        the experts over EP x expert TP (all ones: the whole layer)."""
        split, replicated, _, _ = self.moe_layer_parameters_split()
        routed = self.routed_expert_parameters(expert, expert_tensor or tensor)
        return -(-split // tensor) + replicated + routed

    def routed_expert_parameters(self, expert: int = 1, expert_tensor: int = 1) -> int:
        """One MoE layer's routed experts on one rank: its 1/EP of the experts, each split
        over expert TP (fc1 and its bias, fc2's weight; fc2's bias whole)."""
        assert self.experts is not None
        _, _, routed, routed_whole = self.moe_layer_parameters_split()
        count = self.experts.count
        per_expert = -(-routed // count // expert_tensor) + routed_whole // count
        return count // expert * per_expert

    def stack_parameters(
        self,
        first: int = 0,
        count: int | None = None,
        tensor: int = 1,
        expert: int = 1,
        expert_tensor: int | None = None,
    ) -> int:
        """The layers first .. first + count - 1 (all by default) on one rank."""
        count = self.num_layers - first if count is None else count
        moe = self.moe_layers(first, count)
        dense = (count - moe) * self.layer_parameters(tensor)
        if not moe:
            return dense
        return dense + moe * self.moe_layer_parameters(tensor, expert, expert_tensor)

    def active_layer_parameters(self, index: int) -> int:
        """Layer `index`'s parameters one token passes through: a dense layer's all, a MoE
        layer's dense part, router and shared expert, and top_k of its routed experts."""
        if not self.is_moe_layer(index):
            return self.layer_parameters()
        assert self.experts is not None
        split, replicated, routed, routed_whole = self.moe_layer_parameters_split()
        per_expert = (routed + routed_whole) // self.experts.count
        return split + replicated + self.experts.top_k * per_expert

    def word_embedding_parameters(self, tensor: int = 1) -> int:
        """The word-embedding table's rows on one TP rank (vocabulary-parallel)."""
        return self.padded_vocab(tensor) * self.hidden_size // tensor

    def position_parameters(self) -> int:
        """Learned positions: a plain (not vocabulary-parallel) table, whole on every rank."""
        if not self.learned_positions:
            return 0
        return (self.max_position_embeddings or self.seq_length) * self.hidden_size

    def total_parameters(self, tensor: int = 1) -> int:
        """All parameters, with the vocabulary padded as it is for `tensor`-way TP."""
        words = self.padded_vocab(tensor) * self.hidden_size
        output = 0 if self.tied_embeddings else words
        stack = self.stack_parameters() + self.norm_parameters()
        return words + self.position_parameters() + stack + output

    def active_parameters(self, tensor: int = 1) -> int:
        """The parameters one token passes through (a MoE model's "active" count; a dense
        model's total)."""
        words = self.padded_vocab(tensor) * self.hidden_size
        output = 0 if self.tied_embeddings else words
        stack = sum(self.active_layer_parameters(i) for i in range(self.num_layers))
        return words + self.position_parameters() + stack + self.norm_parameters() + output


def read_shape(
    model: Mapping,
    vocab_size: int | None = None,
    prefix: str = "model",
    seq_length: int | None = None,
) -> ModelShape:
    """A stack's recipe section. The vocabulary is `vocab_size` when given, else
    `model.padded_vocab_size`, else the tokenizer's (GPT-2's 50257 when unreadable); the
    sequence `seq_length` when given, else model.encoder_seq_length (or data.seq_length)."""
    hidden = require_count(model, "hidden_size", prefix)
    heads = require_count(model, "num_attention_heads", prefix)
    layers = require_count(model, "num_layers", prefix)
    seq = seq_length if seq_length is not None else model.get("encoder_seq_length")
    if seq is None:
        seq = (model.get("data") or {}).get("seq_length")
    seq_key = f"{prefix}.encoder_seq_length"
    if seq is None:
        raise ConfigError(seq_key, "is missing", f"Set {seq_key}=2048 (tokens per sample)")
    if vocab_size is None:
        vocab_size = optional_count(model, "padded_vocab_size", prefix)
    if vocab_size is None:
        vocab_size, _ = tokenizer_vocab(model.get("tokenizer") or {})
    activation = str(model.get("activation") or "gelu")
    ffn = optional_count(model, "ffn_hidden_size", prefix) or 4 * hidden
    return ModelShape(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        seq_length=as_count(seq, seq_key),
        vocab_size=vocab_size,
        num_query_groups=optional_count(model, "num_query_groups", prefix),
        kv_channels=optional_count(model, "kv_channels", prefix),
        gated_mlp=activation in GATED_ACTIVATIONS,
        bias=as_bool(model.get("bias", True), f"{prefix}.bias"),
        tied_embeddings=as_bool(
            model.get("share_embeddings_and_output_weights", True),
            f"{prefix}.share_embeddings_and_output_weights",
        ),
        learned_positions=str(model.get("position_embedding_type") or "learned_absolute")
        == "learned_absolute",
        max_position_embeddings=optional_count(model, "max_position_embeddings", prefix),
        make_vocab_size_divisible_by=optional_count(model, "make_vocab_size_divisible_by", prefix)
        or 128,
        rms_norm=str(model.get("normalization") or "layernorm") == "rmsnorm",
        experts=read_experts(model, prefix, layers, ffn),
        qkv_bias=as_bool(model.get("qkv_bias", False), f"{prefix}.qkv_bias"),
        qk_layernorm=as_bool(model.get("qk_layernorm", False), f"{prefix}.qk_layernorm"),
    )


def read_experts(model: Mapping, prefix: str, layers: int, ffn: int) -> Experts | None:
    """A section's mixture-of-experts keys (None: no `num_moe_experts`, a dense MLP)."""
    count = optional_count(model, "num_moe_experts", prefix)
    if count is None:
        return None
    top_k = model.get("moe_router_topk", 2)
    top_k = as_count(top_k, f"{prefix}.moe_router_topk")
    if top_k > count:
        raise ConfigError(
            f"{prefix}.moe_router_topk",
            f"routes each token to {top_k} experts but there are {count} (num_moe_experts)",
            f"Use at most {count}",
        )
    pre_softmax = as_bool(
        model.get("moe_router_pre_softmax", False), f"{prefix}.moe_router_pre_softmax"
    )
    if top_k == 1 and not pre_softmax:
        raise ConfigError(
            f"{prefix}.moe_router_pre_softmax",
            "is false with moe_router_topk 1: a softmax over the one chosen expert's score is "
            "always 1, so the router would get no gradient",
            "Set moe_router_pre_softmax=true (Switch's: the softmax over all experts, then the "
            "top 1)",
        )
    return Experts(
        count=count,
        top_k=top_k,
        ffn_hidden_size=optional_count(model, "moe_ffn_hidden_size", prefix) or ffn,
        shared_ffn_hidden_size=optional_count(model, "moe_shared_expert_intermediate_size", prefix)
        or 0,
        shared_gate=as_bool(
            model.get("moe_shared_expert_gate", False), f"{prefix}.moe_shared_expert_gate"
        ),
        layer_freq=_layer_pattern(model.get("moe_layer_freq", 1), layers, prefix),
        pre_softmax=pre_softmax,
        balancing=_choice(model, "moe_router_load_balancing_type", "aux_loss", BALANCING, prefix),
        aux_loss_coeff=_number(model, "moe_aux_loss_coeff", prefix) or 0.0,
        z_loss_coeff=_number(model, "moe_z_loss_coeff", prefix),
        capacity_factor=_number(model, "moe_expert_capacity_factor", prefix, positive=True),
        dispatcher=_choice(model, "moe_token_dispatcher_type", "alltoall", DISPATCHERS, prefix),
        grouped_gemm=as_bool(model.get("moe_grouped_gemm", False), f"{prefix}.moe_grouped_gemm"),
    )


def _layer_pattern(value: Any, layers: int, prefix: str) -> int | tuple[int, ...]:
    key = f"{prefix}.moe_layer_freq"
    if isinstance(value, str) and value.strip().startswith("["):
        with contextlib.suppress(ValueError):
            value = json.loads(value)
    if isinstance(value, Sequence) and not isinstance(value, str):
        pattern = tuple(value)
        if len(pattern) != layers or any(v not in (0, 1) or isinstance(v, bool) for v in pattern):
            raise ConfigError(
                key,
                f"{list(pattern)} is not a 0/1 pattern with one entry for each of the {layers} "
                "layers",
                f"Give {layers} zeros and ones (1: that layer has the experts), or a whole "
                "number n (every n-th layer)",
            )
        if not any(pattern):
            raise ConfigError(key, "puts the experts in no layer", "Mark at least one layer 1")
        return pattern
    return as_count(value, key)


def _choice(model: Mapping, name: str, default: str, allowed: tuple[str, ...], prefix: str) -> str:
    value = model.get(name, default)
    value = default if value is None else str(value)
    if value not in allowed:
        raise ConfigError(
            f"{prefix}.{name}", f"{value!r} is not supported", f"Use one of: {', '.join(allowed)}"
        )
    return value


def _number(model: Mapping, name: str, prefix: str, positive: bool = False) -> float | None:
    value = model.get(name)
    if value is None:
        return None
    bad = isinstance(value, bool) or not isinstance(value, int | float)
    if bad or value < 0 or (positive and value == 0):
        wanted = "a number above 0" if positive else "a number >= 0"
        raise ConfigError(f"{prefix}.{name}", f"{value!r} is not {wanted}", f"Give {wanted}")
    return float(value)


def tokenizer_vocab(tokenizer: Mapping) -> tuple[int, bool]:
    """The tokenizer's vocabulary (with T5's sentinel tokens) when its file can be read now,
    else the usual size for its type; the flag says whether it was assumed."""
    model, vocab = tokenizer.get("model"), tokenizer.get("vocab_file")
    extra = int(tokenizer.get("num_sentinel_tokens") or 0)
    try:
        if model and Path(str(model)).is_file() and not str(model).endswith(".json"):
            import sentencepiece

            processor = sentencepiece.SentencePieceProcessor(model_file=str(model))
            return int(processor.get_piece_size()) + extra, False
        if model and Path(str(model)).is_file():
            data = json.loads(Path(str(model)).read_text())
            return len(data["model"]["vocab"]) + len(data.get("added_tokens") or []), False
        if vocab and Path(str(vocab)).is_file() and str(vocab).endswith(".txt"):
            lines = Path(str(vocab)).read_text(encoding="utf-8").splitlines()
            return len([line for line in lines if line.strip()]) + extra, False
        if vocab and Path(str(vocab)).is_file():
            return len(json.loads(Path(str(vocab)).read_text())), False
    except (OSError, ValueError, KeyError, RuntimeError, ImportError):
        pass
    assumed = ASSUMED_VOCAB.get(str(tokenizer.get("type")), GPT2_VOCAB)
    return assumed + extra, True


# ----- reading recipe values ---------------------------------------------------------------


def as_count(value: Any, key: str, minimum: int = 1) -> int:
    """A whole number >= minimum (YAML gives ints; a float such as 4.0 is refused too)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(key, f"{value!r} is not an integer", f"Give a whole number >= {minimum}")
    if value < minimum:
        raise ConfigError(key, f"{value} is below {minimum}", f"Give a whole number >= {minimum}")
    return value


def as_bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, f"{value!r} is not true or false", "Give true or false")
    return value


def require_count(section: Mapping, name: str, prefix: str) -> int:
    key = f"{prefix}.{name}"
    value = section.get(name)
    if value is None:
        raise ConfigError(key, "is missing", f"Set {key}=<a whole number>")
    return as_count(value, key)


def optional_count(section: Mapping, name: str, prefix: str) -> int | None:
    value = section.get(name)
    return None if value is None else as_count(value, f"{prefix}.{name}")
