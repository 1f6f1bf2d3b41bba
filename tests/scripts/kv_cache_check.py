"""The KV cache of a served model's family (jobs/inference/kv_cache.py for GPT,
seq2seq_cache.py for T5 and mT5) on a real model, one process; prints one JSON object (rank 0) for
tests/test_kv_cache.py:

python -m tests.scripts.kv_cache_check MODEL.nemo [TP [PP]]   (under torchrun: TP x PP processes)

Every logits row the cache returns is compared with the model's full pass over the sequence
(ModelRunner.logits, no cache), through joins, forks, drops, a move to the right (a prompt
longer than the frontier joins) and compactions (the frontier reaches the end).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from launcher_scripts.jobs.inference.generation import (
    GenerationParams,
    Recomputing,
    generate,
)
from launcher_scripts.jobs.inference.kv_cache import CacheFull
from launcher_scripts.jobs.inference.runner import close_runner
from launcher_scripts.jobs.inference.served import open_served

ModelRunner = Any  # a family's Decoding with whole-row `logits` (ModelRunner, Seq2SeqRunner)


def full_pass(runner: ModelRunner, rows: list[list[int]]) -> torch.Tensor:
    logits = runner.logits(rows)
    return torch.stack([logits[i, len(row) - 1] for i, row in enumerate(rows)])


def generated(runner: ModelRunner, row: list[int]) -> int:
    """The tokens a row holds in the cache: an encoder-decoder's encoder ids are not there."""
    start = getattr(runner, "start_id", None)
    return len(row) - row.index(start, 1) if start is not None else len(row)


def scripted(runner: ModelRunner, tokenizer: Any) -> dict:
    """A script of cache operations on a 3-slot cache; the largest difference from the full
    pass, and what the cache did."""
    short = tokenizer.encode("We like")
    long = tokenizer.encode("In the morning the river was near the village")
    # Where a sequence ends, and the cache's positions: the shared frontier reaches the end.
    longest, positions = (20, 24) if not hasattr(runner, "start_id") else (14, 16)
    cache = runner.cache(3, positions)
    handles, logits = cache.add([short])
    rows = [list(short)]
    worst = 0.0
    events = {"moved_right": 0, "compacted": 0, "forked": 0, "dropped": 0, "joined": 0}
    for step in range(40):
        tokens = logits.argmax(-1).tolist()
        for row, token in zip(rows, tokens, strict=True):
            row.append(token)
        if step in (2, 20) and len(handles) < 3:  # a longer prompt joins a young frontier
            before = cache.frontier
            added, first = cache.add([long])
            events["moved_right"] += before < len(long)
            events["joined"] += 1
            worst = max(worst, float((first - full_pass(runner, [list(long)])).abs().max()))
            handles += added
            rows.append([*long, int(first.argmax(-1))])
            tokens.append(rows[-1][-1])
        if step == 6 and len(handles) < 3:
            handles.append(cache.fork(handles[0]))
            rows.append(list(rows[0]))
            tokens.append(tokens[0])
            events["forked"] += 1
        for index in reversed(range(len(rows))):  # a sequence at its longest ends
            if generated(runner, rows[index]) >= longest or (step == 12 and index == 1):
                cache.drop(handles[index])
                del handles[index], rows[index], tokens[index]
                events["dropped"] += 1
        if not handles:
            handles, logits = cache.add([short])
            rows = [list(short)]
            continue
        frontier = cache.frontier
        logits = cache.step(handles, tokens)
        events["compacted"] += cache.frontier <= frontier
        worst = max(worst, float((logits - full_pass(runner, rows)).abs().max()))
    return {"max_diff": worst, **events}


def partial_step(runner: ModelRunner) -> None:
    cache = runner.cache(2, 8)
    handles, _ = cache.add([[5, 6], [7]])
    cache.step(handles[:1], [5])


def refusals(runner: ModelRunner) -> dict[str, str]:
    found = {}
    cache = runner.cache(1, 8)
    handles, _ = cache.add([[5, 6, 7]])
    for name, call in {
        "slots": lambda: cache.add([[5]]),
        "positions": lambda: runner.cache(2, 8).add([list(range(5, 14))]),
        "partial_step": lambda: partial_step(runner),
        "unknown": lambda: cache.drop(handles[0] + 99),
    }.items():
        try:
            call()
        except (CacheFull, ValueError, KeyError) as error:
            found[name] = f"{type(error).__name__}: {error}"
    return found


def engine(runner: ModelRunner, tokenizer: Any, max_length: int) -> dict:
    """generate() through the cache against generate() rerunning whole rows (no cache)."""
    prompts = ["The history of", "A", "In the morning the river was"]
    same = {}
    for name, params in {
        "greedy": GenerationParams(tokens_to_generate=20, top_k=1),
        "beam": GenerationParams(tokens_to_generate=10, beam_width=3),
        "sampled": GenerationParams(tokens_to_generate=20, top_k=20, random_seed=7),
    }.items():
        ours = generate(runner, tokenizer, prompts, params, max_length=max_length)
        plain = generate(
            Recomputing(runner.logits), tokenizer, prompts, params, max_length=max_length
        )
        same[name] = [asdict(c) for c in ours] == [asdict(c) for c in plain]
    return same


def prompt_tuned(runner: ModelRunner, tokenizer: Any, max_length: int) -> dict:
    """A P-tuning prompt (random, 4 virtual tokens) on the model, its placeholders before
    every prompt: generate() through the cache (Prefixed) against whole rows (prompt_logits,
    what sequence parallelism still uses), and that the prompt changed the logits."""
    import torch

    from launcher_scripts.jobs.fine_tuning.answers import prompt_logits
    from launcher_scripts.jobs.fine_tuning.peft import attach
    from launcher_scripts.jobs.inference.generation import Prefixed
    from launcher_scripts.tuning import PeftSettings

    prompts = ["The history of", "In the morning the river was"]
    params = GenerationParams(tokens_to_generate=12, top_k=20, random_seed=3)
    prefix = [tokenizer.eod_id] * 4
    limit = max_length - len(prefix)

    def first_logits() -> torch.Tensor:
        return Prefixed(runner, prefix).cache(1, 16).add([tokenizer.encode(prompts[0])])[1]

    before = first_logits()
    settings = PeftSettings("ptuning", virtual_tokens=4, encoder_hidden=32)
    attached = attach(runner.chunks, settings, runner.chunks[0].config)
    torch.manual_seed(0)
    for module in attached.modules:
        for parameter in module.parameters():
            parameter.data.normal_(0, 1)
    try:
        changed = float((first_logits() - before).abs().max())
        cached = generate(Prefixed(runner, prefix), tokenizer, prompts, params, max_length=limit)
        rows = generate(prompt_logits(runner, prefix), tokenizer, prompts, params, max_length=limit)
    finally:
        attached.remove()
    return {
        "same": [asdict(c) for c in cached] == [asdict(c) for c in rows],
        "prompt_changed_logits": changed > 1e-3,
    }


def lean_layers(runner: ModelRunner, tokenizer: Any) -> dict:
    """The runner's layers and MLPs with the inference forward (lean_layer.py) against
    megatron-core's own forward: the whole-row pass and a cache's first logits, the largest
    difference."""
    from launcher_scripts.jobs.inference import lean_layer

    rows = [tokenizer.encode("The history of the river"), tokenizer.encode("A")]
    lean = [
        module
        for chunk in runner.chunks
        for module in chunk.modules()
        if getattr(vars(module).get("forward"), "__module__", None) == lean_layer.__name__
    ]

    def outputs() -> list[torch.Tensor]:
        return [full_pass(runner, rows), runner.cache(2, 16).add(rows)[1]]

    leaned = outputs()
    forwards = [vars(module).pop("forward") for module in lean]
    try:
        own = outputs()
    finally:
        for module, forward in zip(lean, forwards, strict=True):
            module.forward = forward
    worst = max(float((a - b).abs().max()) for a, b in zip(leaned, own, strict=True))
    layers = sum(hasattr(module, "self_attention") for module in lean)
    return {"layers": layers, "mlps": len(lean) - layers, "max_diff": worst}


def main() -> None:
    tensor = int(sys.argv[2]) if len(sys.argv) > 2 else 1  # under torchrun with as many
    pipeline = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    served = open_served(Path(sys.argv[1]), tensor=tensor, pipeline=pipeline, on_gpu=False)
    runner = served.decoding
    try:
        report = {
            "script": scripted(runner, served.tokenizer),
            "engine": engine(runner, served.tokenizer, served.max_length),
            "lean_layers": lean_layers(runner, served.tokenizer),
        }
        if not hasattr(runner, "start_id") and tensor * pipeline == 1:  # a decoder's: any ids
            report["refusals"] = refusals(runner)
            report["prompt_tuned"] = prompt_tuned(runner, served.tokenizer, served.max_length)
    finally:
        close_runner()
    if os.environ.get("RANK", "0") == "0":  # every rank has the same; two prints can interleave
        print(json.dumps(report))


if __name__ == "__main__":
    main()
