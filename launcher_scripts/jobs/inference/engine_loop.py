"""In-flight batching for a server: one thread steps one Engine over a KV cache held for the
server's life; a request submitted while others run joins their batch at the next step, and a
finished one leaves it (and answers) at once, whatever the others still have to generate.

    loop = EngineLoop(model, slots=16, positions=model.max_length)
    completions = loop.submit(prompts, params).result()   # from any thread
    loop.close()

Requests are admitted in order while the cache has slots for them (a request's prompts times
its beams); one that could never fit is refused when submitted. A request cancelled (its
client went away) drops its sequences at the next step. A TP/PP group runs the loop on rank 0
over a `broadcast_cache.Leader`, whose cache calls the other ranks repeat.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from launcher_scripts.jobs.inference.engine import Engine


class Refused(ValueError):
    """A request this loop can never hold: one line for the client."""


@dataclass
class _Waiting:
    task: Any
    future: Future
    listener: Callable[[Any], None] | None = None  # called with the task after each of its steps


class EngineLoop:
    def __init__(self, model: Any, tokenizer: Any, slots: int, positions: int) -> None:
        from launcher_scripts.jobs.inference.generation import decoding_of

        self.tokenizer = tokenizer
        self.slots, self.positions = slots, positions
        self.engine = Engine(decoding_of(model).cache(slots, positions))
        self._waiting: collections.deque[_Waiting] = collections.deque()
        self._running: dict[int, _Waiting] = {}  # id(task) -> its request
        self._cancelled: set[int] = set()  # id(task) of running requests to stop
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- the server's side ---------------------------------------------------------------------

    def submit(
        self,
        prompts: Sequence[str],
        params: Any,
        listener: Callable[[Any], None] | None = None,
    ) -> Future:
        """Generation for these prompts; the future's result is generate()'s list. `listener`
        is called on the loop's thread with the task after each step it takes part in (a
        stream reads its text there: generation.StreamedText), and once more when it ends."""
        from launcher_scripts.jobs.inference.generation import task_for

        task = task_for(self.tokenizer, prompts, params, self.positions, replicated=False)
        if task.slots > self.slots:
            raise Refused(
                f"{len(prompts)} prompt(s) x beam_width {params.beam_width} need {task.slots} "
                f"sequences at once; this server holds {self.slots}: send fewer prompts or "
                "beams per request"
            )
        future: Future = Future()
        future.set_running_or_notify_cancel()
        with self._wake:
            if self._closed:
                raise Refused("the server is stopping")
            self._waiting.append(_Waiting(task, future, listener))
            self._wake.notify()
        return future

    def cancel(self, future: Future) -> None:
        """Stop a request's generation at the next step (its client went away)."""
        with self._wake:
            for waiting in list(self._waiting):
                if waiting.future is future:
                    self._waiting.remove(waiting)
                    future.set_exception(Cancelled("cancelled before it started"))
                    return
            for key, running in self._running.items():
                if running.future is future:
                    self._cancelled.add(key)
            self._wake.notify()

    def holding(self) -> Any:
        """While held, the loop admits nothing: requests submitted meanwhile start together."""
        return self._wake

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self._waiting and self.engine.idle:
                    self._wake.wait()
                if self._closed:
                    self._fail_all(Refused("the server stopped"))
                    return
                admitted = self._admissible()
                for waiting in admitted:
                    self._running[id(waiting.task)] = waiting
                cancelled = [task for task in self.engine.tasks if id(task) in self._cancelled]
                listening = [w for w in self._running.values() if w.listener is not None]
            try:
                for waiting in admitted:
                    self.engine.admit(waiting.task)
                for task in cancelled:
                    self.engine.remove(task)
                self.engine.step()
                for waiting in listening:
                    waiting.listener(waiting.task)
            except Exception as error:  # noqa: BLE001  (answered to every request it touches)
                with self._wake:
                    self._fail_all(error)
                continue
            with self._wake:
                self._answer(cancelled)

    def _admissible(self) -> list[_Waiting]:
        """Waiting requests, in order, while their sequences fit beside the running ones."""
        held = sum(task.slots for task in self.engine.tasks)
        admitted = []
        while self._waiting and held + self._waiting[0].task.slots <= self.slots:
            waiting = self._waiting.popleft()
            held += waiting.task.slots
            admitted.append(waiting)
        return admitted

    def _answer(self, cancelled: list[Any]) -> None:
        """Requests whose tasks ended: their results, or Cancelled."""
        stopped = {id(task) for task in cancelled}
        live = {id(task) for task in self.engine.tasks}
        for key in [key for key in self._running if key not in live]:
            waiting = self._running.pop(key)
            self._cancelled.discard(key)
            if key in stopped:
                waiting.future.set_exception(Cancelled("cancelled by its client"))
            else:
                waiting.future.set_result(waiting.task.results())

    def _fail_all(self, error: BaseException) -> None:
        """Every request gets the error; the cache is left empty for the next ones."""
        for task in list(self.engine.tasks):
            try:
                self.engine.remove(task)
            except Exception:  # noqa: BLE001  (a broken cache: the tasks are gone anyway)
                self.engine.tasks = []
        for waiting in [*self._running.values(), *self._waiting]:
            if not waiting.future.done():
                waiting.future.set_exception(error)
        self._running.clear()
        self._waiting.clear()
        self._cancelled.clear()


class Cancelled(Exception):
    """A request stopped before its end."""
