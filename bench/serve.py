"""Generation throughput through a real Triton server against in-process generation.

    python3 bench/serve.py [--model MODEL.nemo] [--tokens 32] [--prompts 16] [--repeat 3]

In one run it
  1. takes --model, or makes the tiny model (data preparation, a short training, conversion),
  2. exports it (the export stage) and starts `python3 -m launcher_scripts serve` on it,
  3. generates greedily from the same prompts, --tokens new tokens each:
       in process   generate() on the served model in this process, batch 1 (one prompt at a time)
                    and batch 8 (eight prompts per generate call);
       through Triton  HTTP requests to the served model, batch 1 (one request at a time) and
                    batch 8 (eight concurrent one-prompt requests, which Triton's dynamic
                    batcher groups),
  4. interleaves the repeats so machine load hits both alike, and prints tokens/s (medians)
     and the ratio Triton / in-process at batch 1 against the target 0.8, and at batch 8.
Tokens are counted from the in-process completions: greedy text is the same both ways (the
serving test checks that), so both sides generate the same number of tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from launcher_scripts.ports import free_port  # noqa: E402

TARGET = 0.8
MODEL_NAME = "gpt3_tiny"
PROMPTS = (
    "The history of",
    "In the morning the",
    "A small village near the river",
    "When the war ended,",
    "Scientists have long believed that",
    "The city council voted to",
    "During the long winter",
    "Her first novel was",
)


def run_main(*overrides: str) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "main.py"), *overrides], capture_output=True, text=True
    )
    if result.returncode:
        sys.exit(f"main.py {' '.join(overrides)} failed:\n{result.stdout[-2000:]}{result.stderr}")


def make_model(work: Path) -> Path:
    print("making the tiny model (data preparation, 60 training steps, conversion)", flush=True)
    run_main(
        "stages=[data_preparation,training,conversion]",
        f"data_dir={work}/data",
        f"base_results_dir={work}/results",
        "training.trainer.max_steps=60",
        "conversion.run.hf_dir_name=null",
    )
    return work / "results" / "gpt3_tiny" / "convert_nemo" / "megatron_gpt.nemo"


def start_server(export_dir: Path, http_port: int, threads: int) -> subprocess.Popen:
    log = export_dir / "bench-serve.log"
    command = [
        sys.executable,
        "-m",
        "launcher_scripts",
        "serve",
        str(export_dir),
        f"--http-port={http_port}",
        f"--grpc-port={free_port()}",
    ]
    with log.open("w") as output:
        process = subprocess.Popen(
            command,
            stdout=output,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=os.environ | {"OMP_NUM_THREADS": str(threads)},
        )
    deadline = time.monotonic() + 300
    while "ready: models" not in log.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"the server did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return process


def infer(http_port: int, prompt: str, tokens: int, model: str = MODEL_NAME) -> str:
    body = {
        "inputs": [
            {"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": [prompt]},
            {"name": "tokens_to_generate", "shape": [1, 1], "datatype": "INT32", "data": [tokens]},
        ]
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/v2/models/{model}/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        outputs = json.loads(response.read())["outputs"]
    return next(o for o in outputs if o["name"] == "text_output")["data"][0]


def time_triton(
    http_port: int, prompts: list[str], tokens: int, batch: int, model: str = MODEL_NAME
) -> float:
    start = time.perf_counter()
    if batch == 1:
        for prompt in prompts:
            infer(http_port, prompt, tokens, model)
    else:
        with ThreadPoolExecutor(batch) as pool:
            list(pool.map(lambda p: infer(http_port, p, tokens, model), prompts))
    return time.perf_counter() - start


def time_in_process(served, prompts: list[str], tokens: int, batch: int) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """Greedy generation on a served.ServedModel in this process: (seconds, tokens made)."""
    from launcher_scripts.jobs.inference.generation import GenerationParams, generate

    params = GenerationParams(tokens_to_generate=tokens, top_k=1)
    generated = 0
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        completions = generate(
            served.decoding,
            served.tokenizer,
            prompts[first : first + batch],
            params,
            max_length=served.max_length,
        )
        generated += sum(len(c.tokens) for c in completions)
    return time.perf_counter() - start, generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a portable .nemo file (default: make one)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per measurement")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads, both sides (default 1)"
    )
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-serve-"))
    model = args.model or make_model(work)
    run_main(
        "stages=[export]", f"base_results_dir={work}/export", f"export.model.nemo_file={model}"
    )
    export_dir = work / "export" / "gpt3_tiny" / "export"
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]

    import torch

    from launcher_scripts.jobs.inference.runner import close_runner
    from launcher_scripts.jobs.inference.served import open_served

    torch.set_num_threads(args.threads)
    served = open_served(model)
    http_port = free_port()
    server = start_server(export_dir, http_port, args.threads)
    results: dict[int, dict[str, list[float]]] = {1: {"ours": [], "triton": []}}
    results[8] = {"ours": [], "triton": []}
    try:
        infer(http_port, prompts[0], 2)  # the first request pays for lazy set-up
        for attempt in range(args.repeat):
            for batch in (1, 8):
                seconds, generated = time_in_process(served, prompts, args.tokens, batch)
                results[batch]["ours"].append(generated / seconds)
                seconds = time_triton(http_port, prompts, args.tokens, batch)
                results[batch]["triton"].append(generated / seconds)
                print(
                    f"repeat {attempt + 1} batch {batch}: in process "
                    f"{results[batch]['ours'][-1]:.1f} tok/s, Triton "
                    f"{results[batch]['triton'][-1]:.1f} tok/s",
                    flush=True,
                )
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)
        close_runner()
    print(
        f"{args.prompts} prompts x {args.tokens} new tokens, greedy, median of {args.repeat}, "
        f"{args.threads} torch thread(s) each side, {os.cpu_count()} CPUs"
    )
    for batch in (1, 8):
        ours = statistics.median(results[batch]["ours"])
        triton = statistics.median(results[batch]["triton"])
        ratio = triton / ours
        verdict = ""
        if batch == 1:
            verdict = f"  (target {TARGET}: {'met' if ratio >= TARGET else 'NOT met'})"
        print(
            f"  batch {batch}: in process {ours:8.1f} tok/s  Triton {triton:8.1f} tok/s  "
            f"ratio {ratio:.2f}{verdict}"
        )


if __name__ == "__main__":
    main()
