"""Generation on a real model, one process; prints one JSON object for tests/test_generation.py:

python -m tests.scripts.generation_check MODEL.nemo

torch.distributed starts once per process, so every model check runs here and the test only
asserts on what it reports.
"""

from __future__ import annotations

import functools
import itertools
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from launcher_scripts.jobs.inference.generation import (
    GenerationParams,
    apply_repetition_penalty,
    generate,
    stream,
)
from launcher_scripts.jobs.inference.runner import ModelRunner, close_runner, open_runner

PROMPTS = ("A", "The history of", "In 1990, the city council voted to build a new")
GREEDY = GenerationParams(tokens_to_generate=24, top_k=1)
BEAM = GenerationParams(tokens_to_generate=12, beam_width=3)
SAMPLED = GenerationParams(tokens_to_generate=24, top_k=50, top_p=0.95, temperature=0.9)


def run_generate(runner: ModelRunner, prompts: Any, params: GenerationParams) -> list[dict]:
    completions = generate(runner, runner.tokenizer, prompts, params, max_length=runner.max_length)
    return [asdict(c) for c in completions]


def run_stream(runner: ModelRunner, prompt: str, params: GenerationParams) -> list[str]:
    pieces = stream(runner, runner.tokenizer, prompt, params, max_length=runner.max_length)
    return list(pieces)


def error(call: Callable[[], object]) -> str:
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return ""


def argmax_loop(runner: ModelRunner, prompt: str, steps: int) -> list[int]:
    """Greedy decoding written out plainly: the reference for the engine's greedy path."""
    ids = runner.tokenizer.encode(prompt)
    generated: list[int] = []
    for _ in range(steps):
        token = int(runner.logits([ids + generated])[0, -1].argmax())
        if token == runner.tokenizer.eod_id:
            break
        generated.append(token)
    return generated


def greedy_checks(runner: ModelRunner) -> dict[str, Any]:
    return {
        "reference": [argmax_loop(runner, p, GREEDY.tokens_to_generate) for p in PROMPTS],
        "one_at_a_time": [run_generate(runner, [p], GREEDY)[0] for p in PROMPTS],
        "batched": run_generate(runner, list(PROMPTS), GREEDY),
        "temperature_0": run_generate(
            runner, list(PROMPTS), replace(GREEDY, top_k=0, temperature=0)
        ),
        "beam_width_1": run_generate(runner, list(PROMPTS), replace(GREEDY, beam_width=1)),
        "streamed": [run_stream(runner, p, GREEDY) for p in PROMPTS],
        "beam_batched": run_generate(runner, list(PROMPTS), BEAM),
        "beam_one_at_a_time": [run_generate(runner, [p], BEAM)[0] for p in PROMPTS],
    }


def sampling_checks(runner: ModelRunner) -> dict[str, Any]:
    prompt = PROMPTS[1]
    seeded = [replace(SAMPLED, random_seed=seed) for seed in (7, 7, 8)]
    top5 = replace(SAMPLED, top_k=5, top_p=0.0, random_seed=3)
    sampled = run_generate(runner, [prompt], top5)[0]
    ids = runner.tokenizer.encode(prompt)
    logits = runner.logits([ids + sampled["tokens"]])[0]
    # The rank each sampled token had among its step's logits.
    ranks = [
        int((logits[len(ids) - 1 + step] > logits[len(ids) - 1 + step, token]).sum())
        for step, token in enumerate(sampled["tokens"])
    ]
    return {
        "seeded": [run_generate(runner, [prompt], p)[0] for p in seeded],
        "streamed": run_stream(runner, prompt, seeded[0]),
        "top5_ranks": ranks,
    }


def continuation(runner: ModelRunner, prompt: str, generated: list[int]) -> str:
    ids = runner.tokenizer.encode(prompt)
    return runner.tokenizer.decode(ids + generated)[len(runner.tokenizer.decode(ids)) :]


def stop_checks(runner: ModelRunner) -> dict[str, Any]:
    prompt = PROMPTS[1]
    greedy = run_generate(runner, [prompt], GREEDY)[0]
    text = greedy["text"]
    # A stop word from the middle of the greedy text, most likely spanning tokens.
    word = text[len(text) // 2 : len(text) // 2 + 6]
    params = replace(GREEDY, stop_words=("never in this text", word))
    stopped = run_generate(runner, [prompt], params)[0]
    kept = len(stopped["tokens"])
    return {
        "greedy": greedy,
        "word": word,
        "stopped": stopped,
        # The text of the kept tokens, and of one greedy token more.
        "kept_text": continuation(runner, prompt, greedy["tokens"][:kept]),
        "next_text": continuation(runner, prompt, greedy["tokens"][: kept + 1]),
        "streamed": run_stream(runner, prompt, params),
        "beam": run_generate(runner, [prompt], replace(params, beam_width=2))[0],
    }


def restricted(runner: ModelRunner, allowed: list[int]) -> Callable[[list[list[int]]], Any]:
    """The real model with every token but `allowed` masked: small enough to search exhaustively."""
    mask = torch.full((runner.vocab_size,), -torch.inf)
    mask[allowed] = 0.0

    def logits(batch: list[list[int]]) -> torch.Tensor:
        return runner.logits(batch) + mask

    return logits


def exhaustive_best(
    runner: ModelRunner, prompt: list[int], allowed: list[int], params: GenerationParams
) -> tuple[list[int], float]:
    """Score every finished sequence (ending in eod, or `tokens_to_generate` long) by hand."""
    logits_fn = restricted(runner, allowed)
    eod, steps = runner.tokenizer.eod_id, params.tokens_to_generate
    words = [t for t in allowed if t != eod]

    @functools.cache
    def logprobs(prefix: tuple[int, ...]) -> torch.Tensor:
        row = logits_fn([prompt + list(prefix)])[0, -1].unsqueeze(0)
        seen = [prompt + list(prefix)]
        return apply_repetition_penalty(row, seen, params.repetition_penalty)[0].log_softmax(-1)

    best: tuple[list[int], float] = ([], -float("inf"))
    for length in range(1, steps + 1):
        for prefix in itertools.product(words, repeat=length - 1):
            dist = logprobs(prefix)
            total = sum(float(logprobs(prefix[:i])[prefix[i]]) for i in range(len(prefix)))
            ends = [eod] if length < steps else [eod, *words]
            for last in ends:
                sequence = [*prefix, last]
                score = (total + float(dist[last])) * length**params.length_penalty
                kept = sequence[:-1] if last == eod else sequence
                if score > best[1]:
                    best = (kept, score)
    return best


def beam_checks(runner: ModelRunner) -> list[dict[str, Any]]:
    """Beam search as wide as every prefix is exact: it must find the exhaustive optimum, for
    vocabularies of 4 random likely tokens and eod, with and without the penalties."""
    prompt = runner.tokenizer.encode(PROMPTS[1])
    eod = runner.tokenizer.eod_id
    likely = [t for t in runner.logits([prompt])[0, -1].topk(40).indices.tolist() if t != eod]
    choose = torch.Generator().manual_seed(0)
    results = []
    for case in range(5):
        picks = torch.randperm(len(likely), generator=choose)[:4].tolist()
        allowed = [*(likely[i] for i in picks), eod]
        for penalty, length_penalty in ((1.0, -1.0), (1.5, 0.0), (1.0, 2.0)):
            params = GenerationParams(
                tokens_to_generate=3,
                beam_width=len(allowed) ** 2,
                repetition_penalty=penalty,
                length_penalty=length_penalty,
            )
            logits_fn = restricted(runner, allowed)
            found = generate(
                logits_fn, runner.tokenizer, [PROMPTS[1]], params, max_length=runner.max_length
            )[0]
            expected, _ = exhaustive_best(runner, prompt, allowed, params)
            results.append(
                {
                    "case": [case, penalty, length_penalty],
                    "found": found.tokens,
                    "reason": found.finish_reason,
                    "expected": expected,
                }
            )
    return results


def error_checks(runner: ModelRunner) -> dict[str, str]:
    long_prompt = " ".join(["winter"] * runner.max_length)
    fits = runner.tokenizer.decode(runner.tokenizer.encode(long_prompt)[: runner.max_length - 8])
    return {
        "too_long": error(lambda: run_generate(runner, [fits], GREEDY)),
        "too_long_stream": error(lambda: run_stream(runner, fits, GREEDY)),
        "prompt_tokens": str(len(runner.tokenizer.encode(fits))),
        "empty": error(lambda: run_generate(runner, ["ok", ""], GREEDY)),
        "beam_stream": error(lambda: run_stream(runner, "A", replace(GREEDY, beam_width=2))),
    }


def main() -> None:
    runner = open_runner(Path(sys.argv[1]))
    try:
        report = {
            "max_length": runner.max_length,
            "eod": runner.tokenizer.eod_id,
            "greedy": greedy_checks(runner),
            "sampling": sampling_checks(runner),
            "stop": stop_checks(runner),
            "beam": beam_checks(runner),
            "errors": error_checks(runner),
        }
    finally:
        close_runner()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
