"""Tasks over one KV cache: the loop every generation runs, one cache step per token.

A task (generation.SamplingTask, generation.BeamTask) owns some of the cache's sequences: it
says which prompts to add, takes the logits of its sequences, picks their next tokens, forks
and drops its sequences, and says which token each live sequence is fed next. The engine adds
a task's prompts when it is admitted and then steps every live sequence of every task at once,
so a task admitted while others run joins their batch at the next step (in-flight batching),
and a finished one leaves it.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Task(Protocol):
    slots: int  # the most sequences it holds at once
    positions: int  # the most tokens one of its sequences holds

    def prompts(self) -> list[list[int]]: ...

    def begin(self, handles: list[int], logits: torch.Tensor, cache: Any) -> None: ...

    def feeds(self) -> list[tuple[int, int]]: ...

    def advance(self, logits: dict[int, torch.Tensor], cache: Any) -> None: ...

    def release(self, cache: Any) -> None: ...

    @property
    def done(self) -> bool: ...


class Engine:
    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.tasks: list[Task] = []
        self.steps = 0  # cache steps taken

    def admit(self, task: Task) -> None:
        """Add the task's prompts to the cache (one pass over them) and its first tokens."""
        handles, logits = self.cache.add(task.prompts())
        task.begin(handles, logits, self.cache)
        if not task.done:
            self.tasks.append(task)

    def step(self) -> None:
        """One token for every live sequence of every task."""
        feeds = [feed for task in self.tasks for feed in task.feeds()]
        if not feeds:
            return
        handles = [handle for handle, _ in feeds]
        logits = self.cache.step(handles, [token for _, token in feeds])
        self.steps += 1
        rows = dict(zip(handles, logits, strict=True))
        for task in self.tasks:
            task.advance(rows, self.cache)
        self.tasks = [task for task in self.tasks if not task.done]

    def remove(self, task: Task) -> None:
        """Stop a task before its end: its sequences leave the cache."""
        task.release(self.cache)
        self.tasks = [other for other in self.tasks if other is not task]

    @property
    def idle(self) -> bool:
        return not self.tasks
