"""What the families' Hugging Face exports and imports share: megatron-core's fused attention
weights split the way transformers keeps them (and merged back), the dtype names of
config.json, an import's tensors planned from the checkpoint's, and the vocabulary rows an
import pads for tensor parallelism and an export drops again."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from launcher_scripts.formats.portable import HF_VOCAB_SIZE
from launcher_scripts.formats.safetensors_stream import Reader, StreamedTensor, TensorSource

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def split_qkv(
    weight: torch.Tensor, heads: int, groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron-core stores Q, K and V interleaved by query group: for each group, its query
    heads, then its key head, then its value head (rows). Returns Q, K, V stacked plainly."""
    per_group = heads // groups
    rest = weight.shape[1:]
    grouped = weight.reshape(groups, per_group + 2, head_dim, *rest)
    q = grouped[:, :per_group].reshape(heads * head_dim, *rest)
    k = grouped[:, per_group].reshape(groups * head_dim, *rest)
    v = grouped[:, per_group + 1].reshape(groups * head_dim, *rest)
    return q, k, v


def split_kv(weight: torch.Tensor, heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-attention's fused key-value weight, interleaved per head: [k_h; v_h] for each."""
    rest = weight.shape[1:]
    paired = weight.reshape(heads, 2, head_dim, *rest)
    return (
        paired[:, 0].reshape(heads * head_dim, *rest),
        paired[:, 1].reshape(heads * head_dim, *rest),
    )


def head_dims(model: Any) -> tuple[int, int, int]:
    """(heads, query groups, head size) of a model section (or a T5 block)."""
    heads = int(model.num_attention_heads)
    groups = int(model.get("num_query_groups") or heads)
    head_dim = int(model.get("kv_channels") or model.hidden_size // heads)
    return heads, groups, head_dim


def dtype_name(tensor: torch.Tensor) -> str:
    return DTYPE_NAMES[tensor.dtype]


def merge_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int, head_dim: int
) -> torch.Tensor:
    """split_qkv's inverse: separate Q, K and V weights as megatron-core's fused one."""
    per_group = heads // groups
    rest = q.shape[1:]
    grouped = torch.cat(
        [
            q.reshape(groups, per_group, head_dim, *rest),
            k.reshape(groups, 1, head_dim, *rest),
            v.reshape(groups, 1, head_dim, *rest),
        ],
        dim=1,
    )
    return grouped.reshape((heads + 2 * groups) * head_dim, *rest)


def merge_kv(k: torch.Tensor, v: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """split_kv's inverse: [k_h; v_h] for each head."""
    rest = k.shape[1:]
    paired = torch.stack(
        [k.reshape(heads, head_dim, *rest), v.reshape(heads, head_dim, *rest)], dim=1
    )
    return paired.reshape(2 * heads * head_dim, *rest)


# One of our layer tensors as a function of (read a checkpoint tensor by name, layer index).
Piece = Callable[[Reader, int], torch.Tensor]


def copied(source: TensorSource, names: dict[str, str]) -> list[StreamedTensor]:
    """Our tensors that are checkpoint tensors as they are: ours -> theirs."""
    return [
        StreamedTensor.planned(ours, source, lambda read, _i, theirs=theirs: read(theirs))
        for ours, theirs in names.items()
    ]


def stacked(source: TensorSource, pieces: dict[str, Piece], layers: int) -> list[StreamedTensor]:
    """Our layer tensors, each stacked over `layers` layers and made one layer at a time."""
    return [StreamedTensor.planned(name, source, piece, layers) for name, piece in pieces.items()]


# ----- the vocabulary's padding -------------------------------------------------------------
# megatron-core splits a table with a row per vocabulary entry over tensor-parallel ranks, so
# an import pads the checkpoint's rows to a multiple of TP (times make_vocab_size_divisible_by),
# and records how many were the checkpoint's (the model section's portable.HF_VOCAB_SIZE) for
# the export to write back exactly those. The rows past the tokenizer's are no token:
# generation and evaluation read the logits of the tokenizer's ids only.

VOCAB_TABLES = (
    "embedding.word_embeddings.weight",
    "output_layer.weight",  # GPT's own output layer
    "lm_head.output_layer.weight",  # T5's
    "lm_head.output_layer.bias",
)


def padded_vocabulary(tensors: list[StreamedTensor], rows: int) -> list[StreamedTensor]:
    """The tensors with a row per vocabulary entry padded to `rows` as Megatron's checkpoint
    converters pad them: copies of the last row (a padded entry scores as the last one)."""
    return [_padded(t, rows) if t.name in VOCAB_TABLES else t for t in tensors]


def _padded(tensor: StreamedTensor, rows: int) -> StreamedTensor:
    extra = rows - tensor.shape[0]
    if extra == 0:
        return tensor

    def pieces() -> Iterator[torch.Tensor]:
        last = None
        for piece in tensor.pieces():
            yield piece
            last = piece
        assert last is not None, tensor.name
        yield last[-1:].expand(extra, *last.shape[1:])

    return StreamedTensor(tensor.name, (rows, *tensor.shape[1:]), tensor.dtype, pieces)


def unpadded_vocabulary(model: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The export's tensors: the rows an import padded dropped (none for a model that was not
    imported, whose every row is its own)."""
    rows = model.get(HF_VOCAB_SIZE)
    if rows is None:
        return tensors
    return {
        name: value[: int(rows)] if name in VOCAB_TABLES else value
        for name, value in tensors.items()
    }
