"""DPO's training speed against TRL's DPOTrainer, on the same tiny model, pairs and batch.

    python3 bench/dpo.py [--workdir DIR] [--steps 30] [--repeat 2]

In one run it
  1. makes the tiny model (data preparation, 60 training steps, conversion), or reuses the
     one a previous run left in --workdir, exports it to Hugging Face (GPT2LMHeadModel) with
     the conversion job's own export, and writes preference pairs whose every side is longer
     than the sequence (so each row holds SEQUENCE tokens on both sides);
  2. runs, one process each, CPU, fp32, 8 pairs a step (one micro-batch) x SEQUENCE tokens,
     --steps steps, repeated --repeat times in turn so machine load hits all alike:
       - ours: `stages=[dpo]` (the reference's log-probabilities are computed before the
         first step, from the same weights);
       - TRL as it comes (its reference model runs beside the policy every step);
       - TRL with precompute_ref_log_probs=True (its reference pass before training too:
         the like-for-like comparison);
  3. reads each step's time (ours: metrics.jsonl's train_step_timing; TRL: a callback at each
     step's end), the median after the first WARM_UP_STEPS, and prints steps/s and the
     ratios ours / TRL (target >= 1.0).
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

from bench.serve import run_main  # noqa: E402
from bench.trl_runs import median_step, tiny_model_and_export  # noqa: E402
from bench.tuning import WARM_UP_STEPS, step_seconds  # noqa: E402

PAIRS, SEQUENCE, BETA, LR = 8, 128, 0.1, 1e-5
TARGET = 1.0


def write_pairs(path: Path, count: int = 256) -> None:
    """Pairs from the shipped corpus: a 30-word prompt, answers of 100 words (longer than the
    sequence after the prompt, so each side is cut to it)."""
    corpus = REPO / "launcher_scripts" / "sample_data" / "tiny_corpus.jsonl.gz"
    with gzip.open(corpus, "rt") as lines:
        words = " ".join(json.loads(line)["text"] for line in lines).split()
    draw = random.Random(0)

    def span(size: int) -> str:
        start = draw.randrange(len(words) - size)
        return " ".join(words[start : start + size])

    with path.open("w") as out:
        for _ in range(count):
            pair = {"prompt": span(30), "chosen": " " + span(100), "rejected": " " + span(100)}
            out.write(json.dumps(pair) + "\n")


def ours(work: Path, model: Path, pairs: Path, steps: int, attempt: int) -> float:
    results = work / "runs" / f"ours-{attempt}"
    run_main(
        "stages=[dpo]",
        f"base_results_dir={results}",
        f"dpo.model.pretrained_checkpoint.restore_from_path={model}",
        f"dpo.model.data.data_prefix={{train: [{pairs}], validation: null, test: null}}",
        f"dpo.model.data.seq_length={SEQUENCE}",
        f"dpo.model.global_batch_size={PAIRS}",
        f"dpo.model.micro_batch_size={PAIRS}",
        f"dpo.model.dpo.ref_policy_kl_penalty={BETA}",
        f"dpo.model.optim.lr={LR}",
        "dpo.model.optim.sched.min_lr=0",
        f"dpo.trainer.max_steps={steps}",
        "dpo.trainer.log_every_n_steps=1",
        "dpo.trainer.val_check_interval=100000",
    )
    return step_seconds(results)


def trl(hf_dir: Path, pairs: Path, work: Path, steps: int, precompute: bool) -> float:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    dataset = Dataset.from_list(rows)
    args = DPOConfig(
        output_dir=str(work / "trl-out"),
        beta=BETA,
        learning_rate=LR,
        per_device_train_batch_size=PAIRS,
        max_length=SEQUENCE,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        precompute_ref_log_probs=precompute,
        dataloader_num_workers=0,
    )
    return median_step(
        lambda callbacks: DPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(hf_dir),
            ref_model=AutoModelForCausalLM.from_pretrained(hf_dir),
            args=args,
            train_dataset=dataset,
            processing_class=AutoTokenizer.from_pretrained(hf_dir),
            callbacks=callbacks,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-dpo-"))
    model, hf_dir = tiny_model_and_export(work)
    pairs = work / "dpo_pairs.jsonl"
    write_pairs(pairs)
    seconds: dict[str, list[float]] = {}
    for attempt in range(args.repeat):
        sides = {
            "ours": lambda attempt=attempt: ours(work, model, pairs, args.steps, attempt),
            "trl": lambda: trl(hf_dir, pairs, work, args.steps, precompute=False),
            "trl_precomputed": lambda: trl(hf_dir, pairs, work, args.steps, precompute=True),
        }
        for side, measure in sides.items():
            seconds.setdefault(side, []).append(measure())
            print(f"repeat {attempt + 1} {side}: {seconds[side][-1]:.3f} s/step", flush=True)
    rate = {side: 1 / statistics.median(values) for side, values in seconds.items()}
    print(
        f"{PAIRS} pairs x {SEQUENCE} tokens a step, fp32, CPU, one process, median step after "
        f"{WARM_UP_STEPS}, median of {args.repeat}"
    )
    for side, value in rate.items():
        print(f"  {side:16} {value:6.2f} steps/s")
    for side in ("trl", "trl_precomputed"):
        ratio = rate["ours"] / rate[side]
        verdict = "met" if ratio >= TARGET else "NOT met"
        print(f"  ours / {side}: {ratio:.2f} (target >= {TARGET}: {verdict})")


if __name__ == "__main__":
    main()
