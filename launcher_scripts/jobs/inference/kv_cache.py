"""A KV cache for incremental decoding of a GPT-style decoder stack, at any TP/PP.

The cache is megatron-core's own: a `StaticInferenceContext` passed through the model's
modules, whose attention layers append each new position's keys and values to it and attend
over it. Its buffers are allocated here, one [positions, slots, groups, head dim] pair per
layer: megatron-core would allocate them on `torch.cuda.current_device()`, which a CPU run
lacks, and allocating them up front makes the memory a cache takes known before it is used.

Layout. Sequences live in slots (the cache's batch dimension), packed at the low slots, and
share one frontier: a sequence's tokens fill positions [start, frontier) of its slot, so one
forward step appends a token to every live sequence at the same position, which is what the
static context does. A new sequence joins by filling the positions just before the frontier
(positions before a slot's start are masked); when the frontier reaches the end, every slot is
moved left by the start of the oldest sequence. Learned absolute position embeddings are given
each token's own position; rotary embeddings see the cache position, and attention with rotary
embeddings depends only on the distance between positions, so the offset changes only rounding.
Keys are stored rotated (rope_at_append.py): a move rotates them on by its shift.

Why not megatron-core's engines: its StaticInferenceEngine batches only the requests present at
its start (a request cannot join a running batch, nor a beam fork), and its
DynamicInferenceEngine's paged cache needs CUDA (block tables and kernels on the GPU).

Every rank of a TP/PP group makes the same calls in the same order (each step is collective).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from launcher_scripts.jobs.inference.rope_at_append import rotate_moved, rotated_layers


class CacheFull(RuntimeError):
    """More sequences, or longer ones, than the cache was opened for."""


@dataclass
class _Slot:
    sequence: int  # the caller's handle
    start: int  # first cache position of the sequence's tokens
    length: int  # its tokens (their positions for learned position embeddings)


class KVCache:
    def __init__(self, runner: Any, slots: int, positions: int) -> None:
        from megatron.core.inference.contexts import StaticInferenceContext

        if slots < 1 or positions < 1:
            raise ValueError(f"a cache needs slots and positions >= 1, not {slots}, {positions}")
        self.runner = runner
        self.slots, self.positions = slots, positions
        self.context = StaticInferenceContext(slots, positions)
        self.buffers = _allocate(runner, slots, positions)
        self.context.key_value_memory_dict.update(self.buffers)
        self.rotated = rotated_layers(getattr(runner, "cached_stacks", runner.chunks))
        self.live: list[_Slot] = []  # live[i] is in slot i
        self.frontier = 0
        self._handles = itertools.count()

    @property
    def bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.buffers.values())

    # -- the caller's operations ---------------------------------------------------------------

    def add(self, prompts: Sequence[Sequence[int]]) -> tuple[list[int], torch.Tensor]:
        """New sequences (handles) from token prompts, and each one's next-token logits [k, V]."""
        if not prompts or not all(prompts):
            raise ValueError("every prompt needs at least one token")
        width = max(len(prompt) for prompt in prompts)
        if len(self.live) + len(prompts) > self.slots:
            raise CacheFull(f"{len(self.live)} + {len(prompts)} sequences; {self.slots} slots")
        if width > self.positions:
            raise CacheFull(f"a prompt of {width} tokens; {self.positions} positions")
        if not self.live:
            self.frontier = width
        elif self.frontier < width:
            self._move(width - self.frontier)
        rows = len(prompts)
        eod = self.runner.tokenizer.eod_id
        tokens = torch.full((rows, width), eod, dtype=torch.long)
        positions = torch.zeros((rows, width), dtype=torch.long)
        first = self.frontier - width  # the cache position of column 0
        added = []
        for row, prompt in enumerate(prompts):
            tokens[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            positions[row, width - len(prompt) :] = torch.arange(len(prompt))
            added.append(_Slot(next(self._handles), self.frontier - len(prompt), len(prompt)))
        keys = torch.arange(self.frontier)
        queries = first + torch.arange(width)
        starts = torch.tensor([slot.start for slot in added])
        # [rows, 1, width, frontier]: a query sees its own sequence's keys up to itself.
        mask = (keys[None, None, :] < starts[:, None, None]) | (
            keys[None, None, :] > queries[None, :, None]
        )
        self.context.sequence_len_offset = first
        self.context.batch_size_offset = len(self.live)
        logits = self.runner.forward(tokens, positions, mask.unsqueeze(1), self.context)
        self.live += added
        return [slot.sequence for slot in added], logits[:, -1]

    def step(self, sequences: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """Append one token to every live sequence; the next-token logits [n, V] in the order
        of `sequences`, which must name every live sequence once."""
        order = {slot.sequence: index for index, slot in enumerate(self.live)}
        if sorted(order.get(s, -1) for s in sequences) != list(range(len(self.live))):
            raise ValueError("a step appends a token to every live sequence, each once")
        if self.frontier == self.positions:
            self._compact()
        by_slot = torch.empty(len(self.live), 1, dtype=torch.long)
        for sequence, token in zip(sequences, tokens, strict=True):
            by_slot[order[sequence], 0] = token
        positions = torch.tensor([[slot.length] for slot in self.live])
        starts = torch.tensor([slot.start for slot in self.live])
        mask = torch.arange(self.frontier + 1)[None, :] < starts[:, None]
        self.context.sequence_len_offset = self.frontier
        self.context.batch_size_offset = 0
        logits = self.runner.forward(by_slot, positions, mask[:, None, None, :], self.context)
        self.frontier += 1
        for slot in self.live:
            slot.length += 1
        return logits[[order[s] for s in sequences], -1]

    def fork(self, sequence: int) -> int:
        """A new sequence holding a copy of this one's tokens (a beam's second child)."""
        if len(self.live) == self.slots:
            raise CacheFull(f"all {self.slots} slots hold sequences")
        source = self._index(sequence)
        self._copy_slot(source, len(self.live))
        parent = self.live[source]
        self.live.append(_Slot(next(self._handles), parent.start, parent.length))
        return self.live[-1].sequence

    def drop(self, sequence: int) -> None:
        """Free a sequence's slot; the last live sequence moves into it (slots stay packed)."""
        index = self._index(sequence)
        last = len(self.live) - 1
        if index != last:
            self._copy_slot(last, index)
            self.live[index] = self.live[last]
        self.live.pop()
        if not self.live:
            self.frontier = 0

    # -- moving cache contents -----------------------------------------------------------------

    def _index(self, sequence: int) -> int:
        for index, slot in enumerate(self.live):
            if slot.sequence == sequence:
                return index
        raise KeyError(f"no live sequence {sequence}")

    def _copy_slot(self, source: int, target: int) -> None:
        for keys, values in self.buffers.values():
            keys[: self.frontier, target] = keys[: self.frontier, source]
            values[: self.frontier, target] = values[: self.frontier, source]

    def _move(self, shift: int) -> None:
        """Every slot's contents `shift` positions later (a negative shift: earlier)."""
        held = slice(0, self.frontier) if shift > 0 else slice(-shift, self.frontier)
        moved = slice(held.start + shift, held.stop + shift)
        for keys, values in self.buffers.values():
            keys[moved] = keys[held].clone()
            values[moved] = values[held].clone()
        for number, layer in self.rotated.items():
            rotate_moved(layer, self.buffers[number][0][moved], shift)
        for slot in self.live:
            slot.start += shift
        self.frontier += shift

    def _compact(self) -> None:
        oldest = min(slot.start for slot in self.live)
        if oldest == 0:
            raise CacheFull(f"a sequence holds all {self.positions} positions")
        self._move(-oldest)


@dataclass(frozen=True)
class _CachedLayer:
    """What one attention layer of this rank keeps per position and slot."""

    number: int  # megatron-core's layer_number: the key of the context's memory dict
    groups: int  # key/value heads on this rank
    key_size: int
    value_size: int
    dtype: torch.dtype


def _cached_layers(runner: Any) -> list[_CachedLayer]:
    """The self-attention layers of the runner's cached stacks (its chunks unless it names
    them: an encoder-decoder caches its decoder's). Cross-attention keeps nothing by position."""
    from megatron.core.transformer.attention import Attention, CrossAttention

    layers = []
    for chunk in getattr(runner, "cached_stacks", runner.chunks):
        dtype = next(chunk.parameters()).dtype
        for module in chunk.modules():
            if isinstance(module, Attention) and not isinstance(module, CrossAttention):
                layers.append(
                    _CachedLayer(
                        module.layer_number,
                        module.num_query_groups_per_partition,
                        module.key_hidden_size,
                        module.val_hidden_size,
                        dtype,
                    )
                )
    return layers


def bytes_per_slot(runner: Any, positions: int) -> int:
    """What one slot of `positions` tokens takes in this rank's cache (keys and values)."""
    return sum(
        positions * layer.groups * (layer.key_size + layer.value_size) * layer.dtype.itemsize
        for layer in _cached_layers(runner)
    )


def _allocate(runner: Any, slots: int, positions: int) -> dict[int, tuple[torch.Tensor, ...]]:
    """Empty key and value buffers for each attention layer of this rank, by layer number."""
    device = torch.device("cuda", torch.cuda.current_device()) if runner.on_gpu else "cpu"
    buffers = {}
    for layer in _cached_layers(runner):
        buffers[layer.number] = (
            _buffer(positions, slots, layer.groups, layer.key_size, layer.dtype, device),
            _buffer(positions, slots, layer.groups, layer.value_size, layer.dtype, device),
        )
    if not buffers and getattr(runner, "cached_stacks", runner.chunks):
        raise ValueError("the model has no attention layers to cache")
    return buffers  # none on a pipeline stage that holds no cached stack


def _buffer(
    positions: int, slots: int, groups: int, size: int, dtype: torch.dtype, device: Any
) -> torch.Tensor:
    """One layer's keys or values, [positions, slots, groups, size] as megatron-core indexes
    them. On a CPU the memory is laid out slot- and group-major: the fused attention then
    reads each head's keys as one run of memory rather than one row per position strided by
    the whole batch (a third of a batch-8 step's attention time). A GPU keeps megatron-core's
    own layout, which Transformer Engine's attention takes."""
    if device != "cpu":
        return torch.zeros(positions, slots, groups, size, dtype=dtype, device=device)
    return torch.zeros(slots, groups, positions, size, dtype=dtype).permute(2, 0, 1, 3)
