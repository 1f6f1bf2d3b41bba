"""One layout of the inference search, measured with the generation runner:

    python -m auto_configurator.inference.bench --model M.nemo --tensor T --pipeline P \\
        --prompts prompts.json --batch-sizes 1,4 --output-len 20 --out results.json ...

Started as TP x PP processes (torchrun; one process alone for TP = PP = 1). Every rank builds
the model from the portable file at TP/PP (`open_runner`, the code Triton's model.py calls) and
runs `generate` on the same rows; global rank 0 times each call between two barriers, so a
latency is the wall time for the whole batch to get its tokens on every rank. Per batch size:
one untimed warm-up call, then `--repeats` timed ones. Rank 0 rewrites `--out` after each batch
size, so what was measured survives a later failure (such as running out of memory).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from launcher_scripts.files import write_atomic


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m auto_configurator.inference.bench")
    parser.add_argument("--model", type=Path, required=True, help="portable .nemo file")
    parser.add_argument("--tensor", type=int, default=1)
    parser.add_argument("--pipeline", type=int, default=1)
    parser.add_argument("--prompts", type=Path, required=True, help="JSON list of prompt texts")
    parser.add_argument("--batch-sizes", required=True, help="comma-separated, e.g. 1,4,16")
    parser.add_argument("--output-len", type=int, required=True, help="tokens to generate")
    parser.add_argument("--top-k", type=int, default=1)
    parser.add_argument("--top-p", type=float, default=0.0)
    parser.add_argument("--beam-width", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True, help="results JSON (rank 0 writes)")
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from launcher_scripts.jobs.inference.generation import GenerationParams, generate
    from launcher_scripts.jobs.inference.runner import close_runner, open_runner

    prompts = json.loads(args.prompts.read_text())
    params = GenerationParams(
        tokens_to_generate=args.output_len,
        top_k=args.top_k,
        top_p=args.top_p,
        beam_width=args.beam_width,
        random_seed=args.seed,
    )
    runner = open_runner(args.model, args.tensor, args.pipeline)
    first = dist.get_rank() == 0
    report: dict[str, Any] = {"tensor": args.tensor, "pipeline": args.pipeline, "batches": []}
    try:
        for batch in (int(size) for size in args.batch_sizes.split(",")):
            rows = prompts[:batch]

            def run(rows: list[str] = rows) -> list[Any]:
                return generate(
                    runner.logits, runner.tokenizer, rows, params, max_length=runner.max_length
                )

            entry: dict[str, Any] = {"batch": batch, "latencies_s": [], "generated_tokens": []}
            try:
                run()  # warm-up: first calls at a new shape allocate and pick kernels
                for _ in range(args.repeats):
                    dist.barrier()
                    start = time.perf_counter()
                    completions = run()
                    dist.barrier()
                    entry["latencies_s"].append(time.perf_counter() - start)
                    entry["generated_tokens"].append(sum(len(c.tokens) for c in completions))
                entry["rows_ended_early"] = sum(c.finish_reason != "length" for c in completions)
            except torch.OutOfMemoryError:
                # Larger batches will not fit either; what was measured is kept.
                entry["failure"] = "out of memory"
                report["batches"].append(entry)
                if first:
                    write_atomic(args.out, json.dumps(report, indent=1))
                raise
            report["batches"].append(entry)
            if first:
                write_atomic(args.out, json.dumps(report, indent=1))
            print(f"batch {batch}: {entry['latencies_s']} s", flush=True)
    finally:
        close_runner()


def main(argv: list[str] | None = None) -> int:
    from launcher_scripts.jobs.inference.runner import InferenceError

    args = parse_args(argv)
    try:
        measure(args)
    except (InferenceError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
