"""What the analytical model needs to know about a transformer stack and its training layout.

`ModelShape` is the stack (a decoder-only GPT or an encoder-only BERT: the same layers), `Layout`
how one training run spreads it over GPUs. Both read a training recipe's `model` and `trainer`
sections (`from_recipe`), naming the recipe key in every error. Pure Python: no torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher_scripts.config.checks import require_heads_split
from launcher_scripts.errors import ConfigError
from launcher_scripts.formats.portable_check import GATED_ACTIVATIONS
from launcher_scripts.recipes.precision import PRECISIONS, dtype_of

RECOMPUTE = (None, "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
GPT2_VOCAB = 50257  # assumed when the tokenizer cannot be read
# Other tokenizers' usual sizes, assumed likewise: BERT's uncased and cased WordPiece.
ASSUMED_VOCAB = {"BertWordPieceLowerCase": 30522, "BertWordPieceCase": 28996}


def padded_vocab(vocab_size: int, divisible_by: int, tensor: int) -> int:
    """Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by x TP so that
    every tensor-parallel rank holds an equal, aligned slice of the table."""
    multiple = divisible_by * tensor
    return -(-vocab_size // multiple) * multiple


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

    def layer_parameters_split(self) -> tuple[int, int]:
        """One layer's parameters as (split by TP, replicated on every TP rank).

        Column-parallel layers (QKV, fc1) split their weights and biases; row-parallel layers
        (attention output, fc2) split their weights but every rank keeps the whole bias; the
        two norms are replicated (megatron-core's ColumnParallelLinear / RowParallelLinear).
        """
        h, qkv = self.hidden_size, self.query_size + 2 * self.kv_size
        split = h * qkv + self.query_size * h + h * self.fc1_size + self.ffn_hidden_size * h
        replicated = 2 * self.norm_parameters()
        if self.bias:
            split += qkv + self.fc1_size
            replicated += 2 * h
        return split, replicated

    def layer_parameters(self, tensor: int = 1) -> int:
        """One layer's parameters on one tensor-parallel rank (tensor=1: the whole layer)."""
        split, replicated = self.layer_parameters_split()
        return -(-split // tensor) + replicated

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
        stack = self.num_layers * self.layer_parameters() + self.norm_parameters()
        return words + self.position_parameters() + stack + output

    @classmethod
    def from_recipe(
        cls,
        model: Mapping,
        vocab_size: int | None = None,
        prefix: str = "model",
        seq_length: int | None = None,
    ) -> ModelShape:
        """A training recipe's `model` section. The vocabulary is `vocab_size` when given, else
        `model.padded_vocab_size`, else the tokenizer's (GPT-2's 50257 when unreadable); the
        sequence `seq_length` when given, else model.encoder_seq_length (or data.seq_length)."""
        hidden = require_count(model, "hidden_size", prefix)
        heads = require_count(model, "num_attention_heads", prefix)
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
        return cls(
            num_layers=require_count(model, "num_layers", prefix),
            hidden_size=hidden,
            ffn_hidden_size=optional_count(model, "ffn_hidden_size", prefix) or 4 * hidden,
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
            make_vocab_size_divisible_by=optional_count(
                model, "make_vocab_size_divisible_by", prefix
            )
            or 128,
            rms_norm=str(model.get("normalization") or "layernorm") == "rmsnorm",
        )


@dataclass(frozen=True)
class Layout:
    """How one training run spreads the stack over GPUs, and what it keeps in memory."""

    num_nodes: int
    gpus_per_node: int
    tensor: int = 1
    pipeline: int = 1
    virtual_pipeline: int | None = None
    context: int = 1
    sequence_parallel: bool = False
    micro_batch: int = 1
    global_batch: int = 1
    recompute: str | None = None  # None | "selective" | "full"
    distributed_optimizer: bool = True
    precision: str = "bf16"  # "bf16" | "fp16" | "fp32" (and NeMo's "16", "32", "bf16-mixed"...)
    # Full recompute only (megatron's recompute_method / recompute_num_layers): "uniform"
    # checkpoints the input of every group of `recompute_num_layers` layers; "block"
    # checkpoints the first `recompute_num_layers` layers of each pipeline stage (chunk) and
    # keeps everything of the others.
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    # Gradients accumulated and reduced in fp32 (megatron-core's grad_reduce_in_fp32, which
    # this launcher's trainer sets for fp16 and bf16); False: in the parameters' dtype.
    fp32_grads: bool = True

    @property
    def world(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def data(self) -> int:
        return self.world // (self.tensor * self.pipeline * self.context)

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step and data-parallel rank (gradient accumulation), at least 1."""
        return max(1, self.global_batch // (self.micro_batch * self.data))

    @property
    def dtype(self) -> str:
        """The precision as "bf16", "fp16" or "fp32"."""
        return PRECISIONS.get(str(self.precision), str(self.precision))

    @property
    def element_bytes(self) -> int:
        """Bytes of one weight or activation element."""
        return 4 if self.dtype == "fp32" else 2

    @classmethod
    def from_recipe(cls, cfg: Mapping, prefix: str = "") -> Layout:
        """A training recipe (its `trainer` and `model` sections); `prefix` (e.g. "training.")
        is put before the keys that errors name."""
        trainer, model = cfg["trainer"], cfg["model"]
        tp, mp = f"{prefix}trainer", f"{prefix}model"
        precision = str(trainer.get("precision", "bf16"))
        dtype_of(precision, f"{tp}.precision")
        granularity = model.get("activations_checkpoint_granularity")
        if granularity not in RECOMPUTE:
            raise ConfigError(
                f"{mp}.activations_checkpoint_granularity",
                f"{granularity!r} is not valid",
                "Use selective, full or null",
            )
        method = model.get("activations_checkpoint_method") or "uniform"
        if granularity == "full" and method not in RECOMPUTE_METHODS:
            raise ConfigError(
                f"{mp}.activations_checkpoint_method",
                f"{method!r} is not valid with full recompute",
                "Use uniform or block",
            )
        layers = model.get("activations_checkpoint_num_layers")
        vp = optional_count(model, "virtual_pipeline_model_parallel_size", mp)
        optim = model.get("optim") or {}
        return cls(
            num_nodes=require_count(trainer, "num_nodes", tp),
            gpus_per_node=require_count(trainer, "devices", tp),
            tensor=optional_count(model, "tensor_model_parallel_size", mp) or 1,
            pipeline=optional_count(model, "pipeline_model_parallel_size", mp) or 1,
            virtual_pipeline=None if vp in (None, 1) else vp,
            context=optional_count(model, "context_parallel_size", mp) or 1,
            sequence_parallel=as_bool(
                model.get("sequence_parallel", False), f"{mp}.sequence_parallel"
            ),
            micro_batch=require_count(model, "micro_batch_size", mp),
            global_batch=require_count(model, "global_batch_size", mp),
            recompute=granularity,
            distributed_optimizer=str(optim.get("name", "")) == "distributed_fused_adam",
            precision=precision,
            recompute_method=str(method),
            recompute_num_layers=1
            if layers is None
            else as_count(layers, f"{mp}.activations_checkpoint_num_layers", minimum=0),
        )


def check_layout(shape: ModelShape, layout: Layout, prefix: str = "") -> None:
    """Megatron's divisibility rules, each failure one ConfigError naming the recipe key."""
    mp, tp = f"{prefix}model", f"{prefix}trainer"
    require_heads_split(
        f"{mp}.tensor_model_parallel_size",
        layout.tensor,
        shape.num_attention_heads,
        shape.query_groups,
    )
    rules = [
        (
            shape.ffn_hidden_size % layout.tensor == 0,
            f"{mp}.tensor_model_parallel_size",
            f"{layout.tensor} does not divide ffn_hidden_size {shape.ffn_hidden_size}",
            "Use a divisor of model.ffn_hidden_size",
        ),
        (
            shape.num_layers % (layout.pipeline * (layout.virtual_pipeline or 1)) == 0,
            f"{mp}.pipeline_model_parallel_size",
            f"PP {layout.pipeline} x VP {layout.virtual_pipeline or 1} does not divide the "
            f"{shape.num_layers} layers",
            "Use sizes whose product divides model.num_layers",
        ),
        (
            layout.virtual_pipeline is None or layout.pipeline > 1,
            f"{mp}.virtual_pipeline_model_parallel_size",
            "needs pipeline_model_parallel_size > 1",
            "Set it to null or raise model.pipeline_model_parallel_size",
        ),
        (
            shape.seq_length % layout.context == 0,
            f"{mp}.context_parallel_size",
            f"{layout.context} does not divide the sequence length {shape.seq_length}",
            "Use a divisor of model.encoder_seq_length",
        ),
        (
            layout.world % (layout.tensor * layout.pipeline * layout.context) == 0,
            f"{tp}.num_nodes",
            f"{layout.world} GPUs are not a multiple of TP x PP x CP = "
            f"{layout.tensor * layout.pipeline * layout.context}",
            "Change trainer.num_nodes / trainer.devices or the parallel sizes",
        ),
    ]
    for ok, key, problem, fix in rules:
        if not ok:
            raise ConfigError(key, problem, fix)
    per_step = layout.micro_batch * layout.data
    if layout.global_batch % per_step:
        raise ConfigError(
            f"{mp}.global_batch_size",
            f"{layout.global_batch} is not a multiple of micro_batch_size x data-parallel size "
            f"= {per_step}",
            f"Use a multiple of {per_step}",
        )


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
