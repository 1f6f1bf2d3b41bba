"""Greedy generation through the KV cache against transformers' `generate`, on the same weights.

    python3 bench/generation.py [--prompt 128] [--tokens 256] [--repeat 3] [--workdir DIR]

In one run it
  1. builds two tiny random decoders with transformers itself (GPT-2: learned positions, and
     Llama: rotary, grouped KV heads; 4 layers, hidden 128, 2048 positions) with byte-level
     tokenizers trained on the shipped corpus, and imports each as a user does
     (`python3 main.py stages=[conversion] conversion=hf_import`);
  2. for each model, in this process with one thread, generates greedily --tokens new tokens
     after prompts of --prompt tokens, at batch 1 (prompts one at a time) and batch 8, with
     `generate()` on the imported model (the engine serving and evaluation use) and with
     transformers' `generate` (KV cache on) on the Hugging Face model, repeats interleaved;
  3. checks the generated tokens are identical, and prints tokens/s (medians) and the ratio
     ours / transformers (target >= 1.0);
  4. sends 16 requests (prompt 64, 64 new tokens) through the in-flight loop servers use
     (engine_loop.py), all at once against one at a time: the ratio of tokens/s (target >= 3);
  5. times our engine's generated tokens at position ~64 and ~1000 (80 new tokens less 16,
     after prompts of those lengths): the ratio of time per token (target <= 1.5: the cache
     keeps a token's cost from growing with the positions before it).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SPEED_TARGET = 1.0
GROWTH_TARGET = 1.5
SERVED_TARGET = 3.0
CLIENTS = 16
SHAPE = {"vocab_size": 500, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4}
MODELS = {
    "gpt2": (
        "GPT2",
        {
            "vocab_size": SHAPE["vocab_size"],
            "n_embd": SHAPE["hidden_size"],
            "n_inner": SHAPE["intermediate_size"],
            "n_layer": SHAPE["num_hidden_layers"],
            "n_head": 4,
            "n_positions": 2048,
            "activation_function": "gelu_new",
        },
    ),
    "llama": (
        "Llama",
        {
            **SHAPE,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
        },
    ),
}


def make_models(folder: Path) -> None:
    """Each model's Hugging Face directory (run in a child: the tokenizer training is quiet)."""
    from tests.scripts.make_hf_gpt import build, save_tokenizer

    scratch = folder / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    for name, (family, settings) in MODELS.items():
        model = build(name, family, settings)
        model.save_pretrained(folder / name)
        save_tokenizer("gpt2" if name == "gpt2" else name, folder / name, scratch)


def import_model(hf_dir: Path, results: Path) -> Path:
    command = [sys.executable, str(REPO / "main.py"), "stages=[conversion]"]
    command += ["conversion=hf_import", f"conversion.hf_model_dir={hf_dir}"]
    command += [f"base_results_dir={results}"]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return results / hf_dir.name / "convert_nemo" / "model.nemo"


def token_prompts(tokenizer, length: int, count: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """`count` prompts of exactly `length` tokens from the shipped corpus, each of which
    decodes to a text that encodes back to the same tokens (so both engines read them)."""
    corpus = REPO / "launcher_scripts" / "sample_data" / "tiny_corpus.jsonl.gz"
    with gzip.open(corpus, "rt") as lines:
        texts = [json.loads(line)["text"] for line in lines]
    prompts: list[list[int]] = []
    joined = " ".join(texts)
    start = 0
    while len(prompts) < count:
        ids = tokenizer.encode(joined[start : start + 40 * length])[:length]
        start += 40 * length // 3
        if len(ids) == length and tokenizer.encode(tokenizer.decode(ids)) == ids:
            prompts.append(ids)
    return prompts


def timed(call):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    result = call()
    return result, time.perf_counter() - start


def compare(model_file: Path, hf_dir: Path, args: argparse.Namespace) -> dict:
    import torch
    import transformers

    from launcher_scripts.jobs.inference.generation import GenerationParams, generate
    from launcher_scripts.jobs.inference.runner import open_runner

    runner = open_runner(model_file, 1, 1, on_gpu=False)
    tokenizer = runner.tokenizer
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    eos = hf_tokenizer.eos_token_id
    prompts = token_prompts(tokenizer, args.prompt, 8)
    texts = [tokenizer.decode(ids) for ids in prompts]
    params = GenerationParams(tokens_to_generate=args.tokens, top_k=1)

    def ours(batch: list[str]) -> list[list[int]]:
        out = generate(runner, tokenizer, batch, params, max_length=runner.max_length)
        return [c.tokens for c in out]

    def hf(batch: list[list[int]]) -> list[list[int]]:
        ids = torch.tensor(batch)
        with torch.no_grad():
            out = theirs.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos,
            )
        rows = []
        for row in out[:, ids.shape[1] :].tolist():
            rows.append(row[: row.index(eos)] if eos in row else row)
        return rows

    figures: dict = {}
    for batch in (1, 8):
        groups = [list(range(i, i + batch)) for i in range(0, 8 if batch == 8 else 4, batch)]
        ours_s, theirs_s, same, generated = [], [], True, 0
        for _ in range(args.repeat):
            mine_total = hf_total = 0.0
            tokens = 0
            for group in groups:
                mine, seconds = timed(lambda group=group: ours([texts[i] for i in group]))
                mine_total += seconds
                reference, seconds = timed(lambda group=group: hf([prompts[i] for i in group]))
                hf_total += seconds
                same &= mine == reference
                tokens += sum(len(row) for row in mine)
            ours_s.append(mine_total)
            theirs_s.append(hf_total)
            generated = tokens
        ours_rate = generated / statistics.median(ours_s)
        hf_rate = generated / statistics.median(theirs_s)
        figures[f"batch{batch}"] = {
            "tokens": generated,
            "ours_tokens_per_s": round(ours_rate, 1),
            "transformers_tokens_per_s": round(hf_rate, 1),
            "ratio": round(ours_rate / hf_rate, 3),
            "identical_tokens": same,
        }
    # Time per generated token deep into the positions against near the start: the time of 80
    # new tokens less that of 16 (so the prompt's own pass, done once, is left out). The two
    # lengths alternate within each repeat, so a change in the machine's load hits both, and
    # a difference of two timings being noisier than a timing, it takes at least 5 repeats.
    texts_at = {n: tokenizer.decode(token_prompts(tokenizer, n, 1)[0]) for n in (64, 1000)}
    runs: dict[int, list[float]] = {n: [] for n in texts_at}
    for _ in range(max(args.repeat, 5)):
        for length, text in texts_at.items():
            counts, seconds = [], []
            for new in (16, 80):
                params = GenerationParams(tokens_to_generate=new, top_k=1)
                out, spent = timed(
                    lambda text=text, params=params: generate(
                        runner, tokenizer, [text], params, max_length=runner.max_length
                    )
                )
                counts.append(len(out[0].tokens))
                seconds.append(spent)
            if counts[1] > counts[0]:
                runs[length].append((seconds[1] - seconds[0]) / (counts[1] - counts[0]))
    per_token = {n: statistics.median(r) if r else float("nan") for n, r in runs.items()}
    figures["served"] = served(runner, args)
    figures["ms_per_token_at_64"] = round(1000 * per_token[64], 2)
    figures["ms_per_token_at_1000"] = round(1000 * per_token[1000], 2)
    figures["growth"] = round(per_token[1000] / per_token[64], 3)
    return figures


def served(runner, args: argparse.Namespace) -> dict:  # type: ignore[no-untyped-def]
    """16 requests through the in-flight loop, concurrent against one at a time."""
    from launcher_scripts.jobs.inference.engine_loop import EngineLoop
    from launcher_scripts.jobs.inference.generation import GenerationParams

    tokenizer = runner.tokenizer
    texts = [tokenizer.decode(ids) for ids in token_prompts(tokenizer, 64, CLIENTS)]
    params = GenerationParams(tokens_to_generate=64, top_k=1)
    loop = EngineLoop(runner, tokenizer, slots=CLIENTS, positions=runner.max_length)
    one, many, tokens = [], [], 0
    try:
        for _ in range(args.repeat):
            answers, seconds = timed(lambda: [loop.submit([t], params).result() for t in texts])
            one.append(seconds)
            tokens = sum(len(a[0].tokens) for a in answers)
            futures, _ = timed(lambda: [loop.submit([t], params) for t in texts])
            _, seconds = timed(lambda futures=futures: [f.result() for f in futures])
            many.append(seconds)
    finally:
        loop.close()
    rate_one = tokens / statistics.median(one)
    rate_many = tokens / statistics.median(many)
    return {
        "clients": CLIENTS,
        "one_at_a_time_tokens_per_s": round(rate_one, 1),
        "concurrent_tokens_per_s": round(rate_many, 1),
        "ratio": round(rate_many / rate_one, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--make-models", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--compare", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_models:
        make_models(args.make_models)
        return
    if args.compare:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(compare(*args.compare, args)))
        return
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-generation-"))
    models = work / "hf"
    subprocess.run([sys.executable, __file__, "--make-models", str(models)], check=True)
    results = {}
    for name in MODELS:
        model_file = import_model(models / name, work / "results")
        command = [sys.executable, __file__, "--compare", str(model_file), str(models / name)]
        command += ["--prompt", str(args.prompt), "--tokens", str(args.tokens)]
        command += ["--repeat", str(args.repeat)]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results[name] = json.loads(output.strip().splitlines()[-1])
    print(f"greedy, prompt {args.prompt} tokens, {args.tokens} new, one thread, fp32, CPU")
    print(f"{'model':8} {'batch':>5} {'ours tok/s':>11} {'HF tok/s':>9} {'ratio':>6} {'same':>5}")
    for name, figures in results.items():
        for batch in (1, 8):
            row = figures[f"batch{batch}"]
            print(
                f"{name:8} {batch:>5} {row['ours_tokens_per_s']:>11} "
                f"{row['transformers_tokens_per_s']:>9} {row['ratio']:>6} "
                f"{row['identical_tokens']!s:>5}"
            )
    for name, figures in results.items():
        print(
            f"{name}: ms per token at position ~64 {figures['ms_per_token_at_64']}, at ~1000 "
            f"{figures['ms_per_token_at_1000']}: growth {figures['growth']} "
            f"(target <= {GROWTH_TARGET})"
        )
    for name, figures in results.items():
        row = figures["served"]
        print(
            f"{name}: {row['clients']} requests through the in-flight loop, concurrent "
            f"{row['concurrent_tokens_per_s']} tok/s against one at a time "
            f"{row['one_at_a_time_tokens_per_s']}: {row['ratio']}x (target >= {SERVED_TARGET})"
        )
    ratios = [f[f"batch{b}"]["ratio"] for f in results.values() for b in (1, 8)]
    print(f"lowest ratio ours / transformers: {min(ratios)} (target >= {SPEED_TARGET})")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
