"""Fine-tuning's training speed against pretraining's, on the same model and batch.

    python3 bench/tuning.py [--workdir DIR] [--steps 30] [--repeat 2]

In one run it
  1. makes the tiny model (data preparation, 60 training steps, conversion), or reuses the
     one a previous run left in --workdir, and writes an SFT task whose every sample is longer
     than the sequence (so each row holds 128 tokens, as pretraining's do);
  2. runs, one process each, CPU, fp32, global batch 8 (micro-batch 4) x 128 tokens, --steps
     steps: pretraining (`stages=[training]` on the prepared data), full SFT
     (`stages=[fine_tuning]` from the converted model) and LoRA on every linear, rank 16
     (`stages=[peft]`), repeated --repeat times in turn so machine load hits all three alike;
  3. reads each step's time from the runs' metrics.jsonl (the median after the first 5
     steps) and prints tokens/s and the ratios SFT / pretraining (target >= 1.0) and LoRA /
     pretraining (target >= 1.2: LoRA computes no gradients for the base weights).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.serve import make_model, run_main  # noqa: E402

GLOBAL_BATCH, MICRO_BATCH, SEQUENCE = 8, 4, 128
TARGETS = {"sft": 1.0, "lora": 1.2}
WARM_UP_STEPS = 5


def write_task(path: Path, samples: int = 256) -> None:
    """SFT pairs from the shipped corpus, 120 words of input and 80 of output: longer than
    128 tokens, so every row is cut to the sequence."""
    corpus = REPO / "launcher_scripts" / "sample_data" / "tiny_corpus.jsonl.gz"
    with gzip.open(corpus, "rt") as lines:
        words = " ".join(json.loads(line)["text"] for line in lines).split()
    draw = random.Random(0)
    with path.open("w") as out:
        for _ in range(samples):
            start = draw.randrange(len(words) - 200)
            record = {
                "input": " ".join(words[start : start + 120]),
                "output": " ".join(words[start + 120 : start + 200]),
            }
            out.write(json.dumps(record) + "\n")


def batch(stage: str) -> list[str]:
    return [
        f"{stage}.trainer.max_steps={{steps}}",
        f"{stage}.trainer.log_every_n_steps=1",
        f"{stage}.trainer.val_check_interval=100000",
        f"{stage}.model.global_batch_size={GLOBAL_BATCH}",
        f"{stage}.model.micro_batch_size={MICRO_BATCH}",
    ]


def tuning(stage: str, model: Path, task: Path) -> list[str]:
    data = f"{stage}.model.data"
    return [
        f"stages=[{stage}]",
        f"{stage}.model.restore_from_path={model}",
        f"{data}.train_ds.file_names=[{task}]",
        f"{data}.train_ds.max_seq_length={SEQUENCE}",
        f"{data}.validation_ds.file_names=null",
        f"{data}.test_ds.file_names=null",
        f"{stage}.trainer.accelerator=cpu",
        f"{stage}.trainer.precision=32",
        f"{stage}.trainer.devices=1",
        f"{stage}.model.optim.sched.warmup_steps=2",
        *batch(stage),
    ]


def runs(work: Path, model: Path, task: Path) -> dict[str, list[str]]:
    """Each side's overrides ({steps} left to fill)."""
    lora = "peft.model.peft.lora_tuning"
    return {
        "pretraining": [
            "stages=[training]",
            f"data_dir={work}/data",
            "training.model.optim.sched.warmup_steps=2",
            *batch("training"),
        ],
        "sft": tuning("fine_tuning", model, task),
        "lora": [
            *tuning("peft", model, task),
            "peft.model.peft.peft_scheme=lora",
            f"{lora}.target_modules=[attention_qkv,attention_dense,mlp_fc1,mlp_fc2]",
            f"{lora}.adapter_dim=16",
        ],
    }


def step_seconds(results: Path) -> float:
    (metrics,) = results.rglob("metrics.jsonl")
    times = [
        record["train_step_timing"]
        for record in map(json.loads, metrics.read_text().splitlines())
        if "train_step_timing" in record and record["step"] > WARM_UP_STEPS
    ]
    if not times:
        sys.exit(f"{metrics}: no step timings past step {WARM_UP_STEPS}: raise --steps")
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-tuning-"))
    model = work / "results" / "gpt3_tiny" / "convert_nemo" / "megatron_gpt.nemo"
    if not model.is_file():
        model = make_model(work)
    task = work / "sft_task.jsonl"
    write_task(task)
    seconds: dict[str, list[float]] = {}
    for attempt in range(args.repeat):
        for side, overrides in runs(work, model, task).items():
            results = work / "runs" / f"{side}-{attempt}"
            filled = [o.replace("{steps}", str(args.steps)) for o in overrides]
            run_main(*filled, f"base_results_dir={results}")
            seconds.setdefault(side, []).append(step_seconds(results))
            print(f"repeat {attempt + 1} {side}: {seconds[side][-1]:.3f} s/step", flush=True)
    tokens = GLOBAL_BATCH * SEQUENCE
    rate = {side: tokens / statistics.median(values) for side, values in seconds.items()}
    print(
        f"global batch {GLOBAL_BATCH} x {SEQUENCE} tokens, fp32, CPU, one process, median step "
        f"after {WARM_UP_STEPS}, median of {args.repeat}"
    )
    for side, value in rate.items():
        print(f"  {side:12} {value:8.0f} tokens/s")
    for side, target in TARGETS.items():
        ratio = rate[side] / rate["pretraining"]
        verdict = "met" if ratio >= target else "NOT met"
        print(f"  {side} / pretraining: {ratio:.2f} (target >= {target}: {verdict})")


if __name__ == "__main__":
    main()
