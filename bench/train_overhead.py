"""Step time of the training program against a bare megatron-core loop on the same model.

    python3 bench/train_overhead.py [--steps 60] [--warmup 10] [--repeat 3] [--processes 1]
                                    [--recipe gpt3/tiny] [--accelerator cpu] [override ...]

In one run it
  1. prepares the default tiny corpus and tokenizer (the data_preparation stage) in a work folder,
  2. times our program (`python -m launcher_scripts.jobs.training.pretrain`) for --steps steps,
     with validation and checkpoints moved past the end so that only training steps are timed:
     the per-step time is the wall-clock time between the metrics records of step --warmup
     and step --steps, so everything the loop does per step counts (data, loss reduction, the
     stop-signal agreement, metrics, logging),
  3. times a bare loop (bench/bare_mcore_loop.py) over the same megatron-core GPTModel, DDP,
     optimizer and pipeline schedule, same batch size and process count, fed from tensors held
     in memory, with nothing else per step,
  4. interleaves the repeats of both so machine load hits both alike, and prints the medians
     and the ratio ours / bare against the target 1.05.
Extra `key=value` arguments are Hydra overrides for the training recipe (both programs read
the same resolved recipe).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from launcher_scripts.config.compose import compose_config  # noqa: E402

TARGET = 1.05


def launch(processes: int, module_or_script: list[str]) -> list[str]:
    if processes == 1:
        return [sys.executable, *module_or_script]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={processes}",
        *module_or_script,
    ]


def prepare_data(work: Path) -> None:
    if (work / "data" / "custom_dataset" / "preprocessed").is_dir():
        return
    subprocess.run(
        [
            sys.executable,
            str(REPO / "main.py"),
            "stages=[data_preparation]",
            f"data_dir={work}/data",
            f"base_results_dir={work}/results",
        ],
        check=True,
        capture_output=True,
    )


def write_recipe(work: Path, args: argparse.Namespace, log_dir: Path) -> Path:
    cfg = compose_config(
        [
            f"training={args.recipe}",
            f"data_dir={work}/data",
            f"base_results_dir={work}/results",
            f"training.exp_manager.explicit_log_dir={log_dir}",
            f"training.trainer.max_steps={args.steps}",
            f"training.trainer.devices={args.processes}",
            f"training.trainer.accelerator={args.accelerator}",
            # Logged at the two timed points only (a realistic cadence): warmup and steps.
            f"training.trainer.log_every_n_steps={args.warmup}",
            f"training.trainer.val_check_interval={args.steps + 1}",
            f"training.exp_manager.checkpoint_callback_params.every_n_train_steps={args.steps + 1}",
            "training.exp_manager.resume_if_exists=false",
            *args.overrides,
        ]
    )
    path = log_dir.with_suffix(".yaml")
    OmegaConf.save(OmegaConf.create(OmegaConf.to_container(cfg.training, resolve=True)), path)
    return path


def time_ours(recipe: Path, log_dir: Path, args: argparse.Namespace) -> float:
    command = ["-m", "launcher_scripts.jobs.training.pretrain", "--config", str(recipe)]
    subprocess.run(launch(args.processes, command), check=True, capture_output=True, cwd=REPO)
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["wall_time"] for r in records if "wall_time" in r}
    return (times[args.steps] - times[args.warmup]) / (args.steps - args.warmup)


def time_bare(recipe: Path, args: argparse.Namespace) -> float:
    script = [str(REPO / "bench" / "bare_mcore_loop.py"), "--config", str(recipe)]
    script += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    result = subprocess.run(
        launch(args.processes, script), check=True, capture_output=True, text=True, cwd=REPO
    )
    line = [ln for ln in result.stdout.splitlines() if ln.startswith("seconds_per_step ")][-1]
    return float(line.split()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--recipe", default="gpt3/tiny")
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the training recipe")
    args = parser.parse_args()
    if args.steps % args.warmup:
        parser.error("--steps must be a multiple of --warmup (both are logged steps)")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-train-"))
    prepare_data(work)
    ours, bare = [], []
    for attempt in range(args.repeat):
        log_dir = work / f"ours-{attempt}"
        recipe = write_recipe(work, args, log_dir)
        ours.append(time_ours(recipe, log_dir, args))
        bare.append(time_bare(recipe, args))
        print(f"repeat {attempt + 1}: ours {ours[-1] * 1e3:.1f} ms/step, bare {bare[-1] * 1e3:.1f}")
    ours_s, bare_s = statistics.median(ours), statistics.median(bare)
    ratio = ours_s / bare_s
    print(
        f"recipe {args.recipe} on {args.processes} process(es), {args.accelerator}, "
        f"steps {args.warmup + 1}..{args.steps} timed, median of {args.repeat}"
    )
    print(f"  our training program : {ours_s * 1e3:8.2f} ms/step")
    print(f"  bare megatron-core   : {bare_s * 1e3:8.2f} ms/step")
    verdict = "meets" if ratio <= TARGET else "misses"
    print(f"ratio ours/bare = {ratio:.3f} ({verdict} the target <= {TARGET})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
