"""GRPO's training speed against TRL's GRPOTrainer, on the same tiny model, prompts, batch,
group size and generation length.

    python3 bench/grpo.py [--workdir DIR] [--steps 20] [--repeat 2]

In one run it
  1. makes the tiny model (data preparation, 60 training steps, conversion), or reuses the
     one a previous run left in --workdir, and exports it to Hugging Face (GPT2LMHeadModel)
     with the conversion job's own export;
  2. runs, one process each, CPU, fp32, PROMPTS prompts x GROUP completions a step (one
     micro-batch), COMPLETION new tokens at most, sampled at temperature 1, one optimizer step
     per rollout batch, no KL term, --steps steps, repeated --repeat times in turn so machine
     load hits both alike:
       - ours: `stages=[grpo]` on the shipped sample prompts;
       - TRL's GRPOTrainer on the same prompts with the same reward (a morning time first);
  3. reads each step's time (ours: metrics.jsonl's train_step_timing, which includes the
     sampling; TRL: a callback at each step's end), the median after the first
     WARM_UP_STEPS, and prints steps/s, the ratio ours / TRL (target >= 1.0), and the share
     of our step spent sampling (metrics.jsonl's generation_share).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.serve import run_main  # noqa: E402
from bench.trl_runs import median_step, tiny_model_and_export  # noqa: E402
from bench.tuning import WARM_UP_STEPS, step_seconds  # noqa: E402

PROMPTS, GROUP, COMPLETION, LR = 8, 8, 16, 1e-5
PATTERN = r"(dawn|noon)\b.*"
TARGET = 1.0
SAMPLES = REPO / "launcher_scripts" / "sample_data" / "preference_train.jsonl"


def ours(work: Path, model: Path, steps: int, attempt: int) -> tuple[float, float]:
    """Our median step time and mean generation share past the warm-up."""
    results = work / "runs" / f"grpo-ours-{attempt}"
    run_main(
        "stages=[grpo]",
        f"base_results_dir={results}",
        f"grpo.model.pretrained_checkpoint.restore_from_path={model}",
        f"grpo.model.data.data_prefix={{train: [{SAMPLES}], validation: null, test: null}}",
        "grpo.model.data.seq_length=64",
        f"grpo.model.global_batch_size={PROMPTS * GROUP}",
        f"grpo.model.micro_batch_size={PROMPTS * GROUP}",
        f"grpo.model.grpo.num_generations={GROUP}",
        f"grpo.model.grpo.max_completion_length={COMPLETION}",
        f"grpo.model.optim.lr={LR}",
        "grpo.model.optim.sched.min_lr=0",
        f"grpo.trainer.max_steps={steps}",
        "grpo.trainer.log_every_n_steps=1",
        "grpo.trainer.val_check_interval=100000",
    )
    (metrics,) = results.rglob("metrics.jsonl")
    shares = [
        row["generation_share"]
        for row in map(json.loads, metrics.read_text().splitlines())
        if "generation_share" in row and row["step"] > WARM_UP_STEPS
    ]
    return step_seconds(results), statistics.mean(shares)


def morning(completions: list[str], **_: object) -> list[float]:
    return [
        float(re.fullmatch(PATTERN, text.strip(), flags=re.DOTALL) is not None)
        for text in completions
    ]


def trl(hf_dir: Path, work: Path, steps: int) -> float:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    rows = [{"prompt": json.loads(line)["prompt"]} for line in SAMPLES.read_text().splitlines()]
    args = GRPOConfig(
        output_dir=str(work / "trl-out"),
        learning_rate=LR,
        per_device_train_batch_size=PROMPTS * GROUP,
        num_generations=GROUP,
        max_completion_length=COMPLETION,
        temperature=1.0,
        beta=0.0,
        num_iterations=1,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        dataloader_num_workers=0,
    )
    return median_step(
        lambda callbacks: GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(hf_dir),
            reward_funcs=morning,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=AutoTokenizer.from_pretrained(hf_dir),
            callbacks=callbacks,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    model, hf_dir = tiny_model_and_export(work)
    seconds: dict[str, list[float]] = {"ours": [], "trl": []}
    shares: list[float] = []
    for attempt in range(args.repeat):
        step, share = ours(work, model, args.steps, attempt)
        seconds["ours"].append(step)
        shares.append(share)
        print(f"repeat {attempt + 1} ours: {step:.3f} s/step ({share:.2f} sampling)", flush=True)
        seconds["trl"].append(trl(hf_dir, work, args.steps))
        print(f"repeat {attempt + 1} trl: {seconds['trl'][-1]:.3f} s/step", flush=True)
    rate = {side: 1 / statistics.median(values) for side, values in seconds.items()}
    print(
        f"{PROMPTS} prompts x {GROUP} completions of up to {COMPLETION} tokens a step, fp32, "
        f"CPU, one process, median step after {WARM_UP_STEPS}, median of {args.repeat}"
    )
    for side, value in rate.items():
        print(f"  {side:6} {value:6.2f} steps/s")
    ratio = rate["ours"] / rate["trl"]
    verdict = "met" if ratio >= TARGET else "NOT met"
    print(f"  ours / trl: {ratio:.2f} (target >= {TARGET}: {verdict})")
    print(f"  our step's share spent sampling: {statistics.median(shares):.2f}")


if __name__ == "__main__":
    main()
