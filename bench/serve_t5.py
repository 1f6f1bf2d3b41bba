"""T5 generation throughput through a real Triton server, against in-process generation and
against transformers' `generate`, on the same model and prompts, in one run.

    python3 bench/serve_t5.py [--workdir DIR] [--tokens 16] [--prompts 16] [--repeat 3]

In one run it
  1. makes the tiny T5 (data preparation with the tests' pinned WordPiece vocabulary, a short
     pretraining, conversion to the portable file and to a Hugging Face directory), or reuses
     the one a previous run left in --workdir;
  2. exports the portable file (export=t5/export_t5) and starts `python3 -m launcher_scripts
     serve` on it;
  3. generates greedily from the same prompts, --tokens new tokens at most each, at batch 1
     (one prompt at a time) and batch 8:
       in process     generate() on the served model in this process (its KV cache);
       through Triton HTTP requests to the served model (batch 8: eight concurrent one-prompt
                      requests, which Triton's dynamic batcher groups);
       transformers   T5ForConditionalGeneration.generate on the exported Hugging Face
                      directory (greedy, its KV cache), fed the same encoder ids;
  4. interleaves the repeats so machine load hits all three alike, and prints tokens/s
     (medians) and the ratios Triton / in process and Triton / transformers.
Tokens are counted from each side's own outputs. Whether the three give the same text is
printed too: they should (the serving test and the Hugging Face export test check it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from serve import REPO, infer, run_main, start_server, time_in_process, time_triton

from launcher_scripts.ports import free_port

MODEL_NAME = "t5_tiny"
PROMPTS = (
    "question: what is the history of the city? context: the city was founded by the king",
    "the river runs through the old town",
    "in the morning the village was quiet",
    "when the war ended, the soldiers returned home",
    "scientists have long believed that the climate",
    "the city council voted to build a new bridge",
    "during the long winter the people of the north",
    "her first novel was published in london",
)
BATCHES = (1, 8)
SIDES = ("ours", "triton", "hf")


def make_model(work: Path) -> Path:
    """The tiny T5's results directory (t5_tiny/convert_nemo/{megatron_t5.nemo, hf})."""
    results = work / "results"
    converted = results / "t5_tiny" / "convert_nemo"
    if (converted / "megatron_t5.nemo").is_file() and (converted / "hf").is_dir():
        return converted
    print("making the tiny T5 (data preparation, 100 training steps, conversion)", flush=True)
    vocab = work / "data" / "custom_dataset" / "bpe" / "custom_sp_tokenizer.vocab.txt"
    vocab.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(REPO / "tests" / "data" / "wordpiece_vocab.txt", vocab)
    run_main(
        "stages=[data_preparation]",
        f"data_dir={work}/data",
        f"base_results_dir={results}",
        "data_preparation.train_tokenizer=false",
        f"data_preparation.vocab_file={vocab}",
        "data_preparation.split_sentences=true",
        "data_preparation.lower_case=true",
    )
    run_main(
        "stages=[training,conversion]",
        "training=t5/tiny",
        "conversion=t5/convert_t5",
        "conversion.model.vocab_file=null",
        "conversion.run.hf_dir_name=hf",
        f"data_dir={work}/data",
        f"base_results_dir={results}",
        "training.trainer.max_steps=100",
    )
    return converted


class HfGreedy:
    """transformers' generate on the exported directory, from our encoder ids."""

    def __init__(self, hf_dir: Path, served) -> None:  # type: ignore[no-untyped-def]
        from transformers import T5ForConditionalGeneration

        self.model = T5ForConditionalGeneration.from_pretrained(hf_dir).eval()
        self.text = served.tokenizer.text  # t5_tuning.T5Text: our ids, our decoding

    def generate(self, prompts: list[str], tokens: int) -> tuple[list[str], int]:
        import torch

        rows = [[*self.text.encode(p), self.text.eos_id] for p in prompts]
        width = max(len(row) for row in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)  # 0: T5's padding
        for index, row in enumerate(rows):
            ids[index, : len(row)] = torch.tensor(row)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=(ids != 0).long(),
                max_new_tokens=tokens,
                do_sample=False,
                num_beams=1,
            )
        texts, generated = [], 0
        for row in out.tolist():
            answer = row[1:]  # after the decoder's start
            # Counted as generate() counts: up to the end token, which is left out.
            if self.text.eos_id in answer:
                answer = answer[: answer.index(self.text.eos_id)]
            generated += len(answer)
            texts.append(self.text.decode(answer))
        return texts, generated


def time_hf(hf: HfGreedy, prompts: list[str], tokens: int, batch: int) -> tuple[float, int]:
    generated = 0
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        generated += hf.generate(prompts[first : first + batch], tokens)[1]
    return time.perf_counter() - start, generated


def same_text(served, hf: HfGreedy, http_port: int, tokens: int) -> str:  # type: ignore[no-untyped-def]
    from launcher_scripts.jobs.inference.generation import GenerationParams, generate

    prompts = list(PROMPTS)
    params = GenerationParams(tokens_to_generate=tokens, top_k=1)
    ours = [
        c.text.strip()
        for c in generate(
            served.decoding, served.tokenizer, prompts, params, max_length=served.max_length
        )
    ]
    triton = [infer(http_port, p, tokens, MODEL_NAME).strip() for p in prompts]
    theirs = [t.strip() for t in hf.generate(prompts, tokens)[0]]
    agree = sum(a == b == c for a, b, c in zip(ours, triton, theirs, strict=True))
    return f"{agree} of {len(prompts)} prompts give the same text on all three sides"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per prompt, at most")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per measurement")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads, every side (default 1)"
    )
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-serve-t5-"))
    converted = make_model(work)
    model = converted / "megatron_t5.nemo"
    run_main(
        "stages=[export]",
        "export=t5/export_t5",
        f"export.run.model_train_name={MODEL_NAME}",
        f"base_results_dir={work}/export",
        f"export.model.nemo_file={model}",
    )
    export_dir = work / "export" / MODEL_NAME / "export"
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]

    import torch

    from launcher_scripts.jobs.inference.runner import close_runner
    from launcher_scripts.jobs.inference.served import open_served

    torch.set_num_threads(args.threads)
    served = open_served(model)
    hf = HfGreedy(converted / "hf", served)
    http_port = free_port()
    server = start_server(export_dir, http_port, args.threads)
    rates = {batch: {side: [] for side in SIDES} for batch in BATCHES}
    try:
        agreement = same_text(served, hf, http_port, args.tokens)
        for attempt in range(args.repeat):
            for batch in BATCHES:
                seconds, ours = time_in_process(served, prompts, args.tokens, batch)
                rates[batch]["ours"].append(ours / seconds)
                seconds = time_triton(http_port, prompts, args.tokens, batch, MODEL_NAME)
                # Triton's text is the in-process text (the serving test): the same tokens.
                rates[batch]["triton"].append(ours / seconds)
                seconds, theirs = time_hf(hf, prompts, args.tokens, batch)
                rates[batch]["hf"].append(theirs / seconds)
                print(
                    f"repeat {attempt + 1} batch {batch}: "
                    + ", ".join(f"{side} {rates[batch][side][-1]:.1f} tok/s" for side in SIDES),
                    flush=True,
                )
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)
        close_runner()
    print(
        f"{args.prompts} prompts x up to {args.tokens} new tokens, greedy, median of "
        f"{args.repeat}, {args.threads} torch thread(s) each side, {os.cpu_count()} CPUs; "
        f"{agreement}"
    )
    for batch in BATCHES:
        ours, triton, theirs = (statistics.median(rates[batch][side]) for side in SIDES)
        print(
            f"  batch {batch}: in process {ours:7.1f} tok/s  Triton {triton:7.1f} tok/s  "
            f"transformers {theirs:7.1f} tok/s  Triton/in-process {triton / ours:.2f}  "
            f"Triton/transformers {triton / theirs:.2f}"
        )


if __name__ == "__main__":
    sys.exit(main())
