"""One server loop for a TP/PP group: rank 0 schedules, the other ranks repeat its cache calls.

A model split over ranks answers a cache call only when every rank makes it (each step is a
collective forward pass). In a server only rank 0 sees requests, so rank 0 sends each cache
call (open, add, step, fork, drop, close) to the group before it makes it itself, and the other
ranks (`follow`) make the same calls in the same order. Only rank 0 picks tokens: the others'
logits are not read, and generation is not replicated (no seed is broadcast).

    rank 0:   loop = EngineLoop(Leader(runner), ...)  ...  leader.stop()
    others:   follow(runner)            # returns when rank 0 stops
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from launcher_scripts.jobs.inference.kv_cache import CacheFull

STOP = "stop"


def _send(call: tuple[Any, ...]) -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:  # alone: nobody to tell
        dist.broadcast_object_list([call], src=0)


def _receive() -> tuple[Any, ...]:
    import torch.distributed as dist

    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Leader:
    """Rank 0's Decoding over the model's own (the runner, or any generation.Decoding): every
    cache it opens tells the other ranks what it does."""

    def __init__(self, decoding: Any) -> None:
        self.decoding = decoding

    def cache(self, slots: int, positions: int) -> LeaderCache:
        _send(("open", slots, positions))
        return LeaderCache(self.decoding.cache(slots, positions))

    def stop(self) -> None:
        _send((STOP,))


class LeaderCache:
    def __init__(self, cache: Any) -> None:
        self.inner = cache

    def add(self, prompts: Sequence[Sequence[int]]) -> tuple[list[int], torch.Tensor]:
        _send(("add", [list(prompt) for prompt in prompts]))
        return self.inner.add(prompts)

    def step(self, sequences: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        _send(("step", list(sequences), list(tokens)))
        return self.inner.step(sequences, tokens)

    def fork(self, sequence: int) -> int:
        _send(("fork", sequence))
        return self.inner.fork(sequence)

    def drop(self, sequence: int) -> None:
        _send(("drop", sequence))
        self.inner.drop(sequence)

    @property
    def live(self) -> list[Any]:
        return self.inner.live


def follow(decoding: Any) -> int:
    """Make rank 0's cache calls on this rank's `decoding` until it stops; the calls made."""
    cache = None
    calls = 0
    while True:
        call = _receive()
        name, arguments = call[0], call[1:]
        if name == STOP:
            return calls
        if name == "open":
            cache = decoding.cache(*arguments)
        elif cache is None:
            raise RuntimeError(f"rank 0 sent {name} before opening a cache")
        else:
            # A call the cache refuses is refused on rank 0 alike, which goes on: so do these.
            with contextlib.suppress(CacheFull, ValueError, KeyError):
                getattr(cache, name)(*arguments)
        calls += 1
