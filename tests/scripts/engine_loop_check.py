"""In-flight batching (jobs/inference/engine_loop.py) on a real model, one process; prints
one JSON object for tests/test_engine_loop.py:

python -m tests.scripts.engine_loop_check MODEL.nemo
"""

from __future__ import annotations

import json
import sys
import threading
from dataclasses import asdict

from launcher_scripts.jobs.inference.engine_loop import Cancelled, EngineLoop, Refused
from launcher_scripts.jobs.inference.generation import GenerationParams, generate
from launcher_scripts.jobs.inference.runner import close_runner, open_runner

PROMPTS = ["The history of", "A", "In the morning the river was", "We like", "Every winter"]
REQUESTS = [
    (PROMPTS[:2], GenerationParams(tokens_to_generate=24, top_k=1)),
    (PROMPTS[2:3], GenerationParams(tokens_to_generate=10, beam_width=3)),
    (PROMPTS[3:], GenerationParams(tokens_to_generate=16, top_k=20, random_seed=11)),
    (PROMPTS[1:4], GenerationParams(tokens_to_generate=8, top_k=1, stop_words=(".",))),
]


def from_threads(loop: EngineLoop, requests: list) -> list[list[dict]]:
    """Each request submitted from a thread of its own, all at once; their answers in order."""
    answers: dict[int, list[dict]] = {}

    def client(index: int) -> None:
        prompts, params = requests[index]
        answers[index] = [asdict(c) for c in loop.submit(prompts, params).result()]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [answers[i] for i in range(len(requests))]


def alone(runner, prompts, params) -> list[dict]:  # type: ignore[no-untyped-def]
    out = generate(runner, runner.tokenizer, prompts, params, max_length=runner.max_length)
    return [asdict(c) for c in out]


def main() -> None:
    runner = open_runner(sys.argv[1], 1, 1, on_gpu=False)
    report: dict = {}
    try:
        loop = EngineLoop(runner, runner.tokenizer, slots=8, positions=runner.max_length)
        # Requests from several threads at once: each answer is what it gets alone.
        answers = from_threads(loop, REQUESTS)
        report["same_as_alone"] = [
            answers[i] == alone(runner, *REQUESTS[i]) for i in range(len(REQUESTS))
        ]
        # Eight greedy requests held back and released together take one step per token
        # between them, not one per token each.
        greedy = GenerationParams(tokens_to_generate=24, top_k=1)
        before = loop.engine.steps
        with loop.holding():
            futures = [loop.submit([PROMPTS[i % len(PROMPTS)]], greedy) for i in range(8)]
        generated = [len(future.result()[0].tokens) for future in futures]
        report["together"] = {"steps": loop.engine.steps - before, "tokens": generated}
        # A short request submitted while a long one runs answers first.
        long = loop.submit([PROMPTS[0]], GenerationParams(tokens_to_generate=100, top_k=1))
        while loop.engine.steps == before + report["together"]["steps"]:
            pass  # the long one has started
        short = loop.submit([PROMPTS[1]], GenerationParams(tokens_to_generate=4, top_k=1))
        short.result()
        report["short_first"] = not long.done()
        long.result()
        # A cancelled request stops; the loop goes on serving, and its cache is empty after.
        mark = loop.engine.steps
        doomed = loop.submit([PROMPTS[0]], GenerationParams(tokens_to_generate=100, top_k=1))
        while loop.engine.steps < mark + 2:
            pass  # it is generating
        loop.cancel(doomed)
        try:
            doomed.result()
            report["cancelled"] = "answered"
        except Cancelled as error:
            report["cancelled"] = str(error)
        after = loop.submit([PROMPTS[3]], GenerationParams(tokens_to_generate=6, top_k=1))
        report["served_after_cancel"] = [asdict(c) for c in after.result()] == alone(
            runner, [PROMPTS[3]], GenerationParams(tokens_to_generate=6, top_k=1)
        )
        report["live_after"] = len(loop.engine.cache.live)
        try:
            loop.submit(PROMPTS[:3], GenerationParams(tokens_to_generate=4, beam_width=3))
            report["refused"] = ""
        except Refused as error:
            report["refused"] = str(error)
        loop.close()
    finally:
        close_runner()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
