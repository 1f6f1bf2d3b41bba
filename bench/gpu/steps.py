"""The GPU suite's steps (bench/gpu/suite.py runs each in its own time-boxed child process).

A step takes a Context and returns {"status": passed|failed|skipped, "figures": {...},
"reason": ...}; the commands it ran are recorded through Context.run. Every figure is measured in
this run; none is copied from elsewhere.
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from itertools import pairwise
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Context:
    scratch: Path  # steps/<name>.json, logs/<name>.log, work/
    work: Path
    rehearse: bool
    commands: list[str] = field(default_factory=list)

    def run(self, command: list[str], timeout: float) -> subprocess.CompletedProcess:
        """Run a command from the repository root, echo its output into the step's log."""
        self.commands.append(shlex.join(command))
        print(f"$ {shlex.join(command)}", flush=True)
        result = subprocess.run(
            command, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
        )
        print(result.stdout[-20000:], result.stderr[-20000:], sep="\n", flush=True)
        return result

    def earlier(self, step: str) -> dict:
        """An earlier step's record in this run ({} when it has none)."""
        path = self.scratch / "steps" / f"{step}.json"
        return json.loads(path.read_text()) if path.exists() else {}


@dataclass
class Step:
    run: Callable[[Context], dict]
    budget_s: float  # on the GPU machine
    rehearsal_s: float  # on CPU


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform_cpu()})"


def platform_cpu() -> str:
    import os

    return f"{os.cpu_count()} cores"


class StepEnds(Exception):  # noqa: N818  (not an error: the step ends with this record)
    """The step cannot run here: its record is this status and reason (suite.child_main)."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.record = {"status": status, "reason": reason}


def on_gpu(context: Context) -> bool:
    """Whether the step runs on the GPU (False: the rehearsal, on CPU); a GPU run on a machine
    without CUDA ends the step as skipped."""
    if context.rehearse:
        return False
    if not cuda():
        raise StepEnds("skipped", "needs CUDA")
    return True


def converted_model(context: Context) -> Path:
    """The conversion step's portable file, which the steps after it read."""
    model_file = context.work / "converted" / "megatron_gpt.nemo"
    if not model_file.exists():
        raise StepEnds("failed", "the conversion step left no portable file")
    return model_file


# --- the matmul ceiling ---------------------------------------------------------------------


def ceiling(context: Context) -> dict:
    """Dense matmul TFLOP/s: bf16 8192^3 on the GPU; fp32 512^3 on CPU in the rehearsal."""
    import torch

    if on_gpu(context):
        size, dtype, device, repeats = 8192, torch.bfloat16, "cuda", 50
    else:
        size, dtype, device, repeats = 512, torch.float32, "cpu", 10
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)

    def timed(n: int) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            torch.matmul(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(3)
    best = min(timed(repeats) / repeats for _ in range(3))
    tflops = 2 * size**3 / best / 1e12
    figures = {"matmul_tflops": round(tflops, 3), "dtype": str(dtype).split(".")[-1]}
    figures.update(size=size, device=device)
    context.commands.append(f"torch.matmul {size}x{size}x{size} {figures['dtype']} on {device}")
    return {"status": "passed", "figures": figures}


# --- training through main.py ---------------------------------------------------------------

STEPS_GPU, WARMUP_GPU = 120, 20
STEPS_CPU, WARMUP_CPU = 12, 4


def training_overrides(context: Context, log_dir: Path, gpu: bool) -> list[str]:
    data = context.work / "data"
    common = [
        f"data_dir={data}",
        f"base_results_dir={context.work}/results",
        f"training.exp_manager.explicit_log_dir={log_dir}",
        "training.trainer.log_every_n_steps=1",
        "training.exp_manager.resume_if_exists=false",
        "training.trainer.num_nodes=1",
        "training.trainer.devices=1",
    ]
    steps = STEPS_GPU if gpu else STEPS_CPU
    common += [
        f"training.trainer.max_steps={steps}",
        f"training.trainer.val_check_interval={steps + 1}",
        f"training.exp_manager.checkpoint_callback_params.every_n_train_steps={steps + 1}",
        "training.model.optim.sched.warmup_steps=2",
        "training.model.optim.sched.constant_steps=0",
    ]
    if not gpu:
        return ["training=gpt3/tiny", *common]
    # gpt3/126m on one GPU, reading the tiny corpus and its SentencePiece tokenizer.
    document = f"{data}/custom_dataset/preprocessed/tiny_corpus_text_document"
    return [
        "training=gpt3/126m",
        *common,
        "training.trainer.accelerator=gpu",
        "training.trainer.precision=bf16",
        "training.model.micro_batch_size=4",
        "training.model.global_batch_size=32",
        "training.model.tokenizer.library=sentencepiece",
        "training.model.tokenizer.type=null",
        f"training.model.tokenizer.model={data}/custom_dataset/bpe/custom_sp_tokenizer.model",
        "training.model.tokenizer.vocab_file=null",
        "training.model.tokenizer.merge_file=null",
        f"training.model.data.data_prefix=[1.0,{document}]",
        "training.model.data.splits_string='80,10,10'",
    ]


def prepare_data(context: Context) -> None:
    if (context.work / "data" / "custom_dataset" / "preprocessed").is_dir():
        return
    command = [sys.executable, "main.py", "stages=[data_preparation]", "cluster_type=local"]
    command += [f"data_dir={context.work}/data", f"base_results_dir={context.work}/results"]
    result = context.run(command, timeout=120)
    if result.returncode:
        raise RuntimeError(f"data preparation failed (exit {result.returncode})")


def records(log_dir: Path) -> list[dict]:
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def write_recipe(overrides: list[str], path: Path) -> Path:
    """The resolved training recipe the job reads, for bench/bare_mcore_loop.py."""
    from omegaconf import OmegaConf

    from launcher_scripts.config.compose import compose_config

    cfg = compose_config(overrides)
    OmegaConf.save(OmegaConf.create(OmegaConf.to_container(cfg.training, resolve=True)), path)
    return path


def train_once(context: Context, name: str, gpu: bool, extra: list[str]) -> dict:
    """One training run through main.py; its figures from metrics.jsonl."""
    log_dir = context.work / name
    overrides = training_overrides(context, log_dir, gpu) + extra
    command = [sys.executable, "main.py", "stages=[training]", "cluster_type=local", *overrides]
    result = context.run(command, timeout=300 if gpu else 120)
    if result.returncode:
        raise RuntimeError(f"{name}: main.py exited {result.returncode}")
    steps, warmup = (STEPS_GPU, WARMUP_GPU) if gpu else (STEPS_CPU, WARMUP_CPU)
    logged = {r["step"]: r for r in records(log_dir) if "reduced_train_loss" in r}
    timed = [logged[s] for s in range(warmup + 1, steps + 1)]
    first = logged[1]["reduced_train_loss"]
    last = statistics.mean(r["reduced_train_loss"] for r in timed[-5:])
    step_s = (logged[steps]["wall_time"] - logged[warmup]["wall_time"]) / (steps - warmup)
    return {
        "steps": len(logged),
        "loss_first": round(first, 4),
        "loss_last5": round(last, 4),
        "loss_falls": last < first,
        "step_s": round(step_s, 5),
        "tokens_per_s": round(statistics.median(r["tokens_per_sec"] for r in timed)),
        "model_tflops_per_gpu": round(
            statistics.median(r["model_tflops_per_gpu"] for r in timed), 3
        ),
        "peak_memory_gb": round(max(r["peak_memory_gb"] for r in timed), 3),
        "overrides": overrides,
    }


def bare_step_s(context: Context, recipe: Path, gpu: bool) -> float:
    steps, warmup = (STEPS_GPU, WARMUP_GPU) if gpu else (STEPS_CPU, WARMUP_CPU)
    command = [sys.executable, "bench/bare_mcore_loop.py", "--config", str(recipe)]
    command += ["--steps", str(steps), "--warmup", str(warmup)]
    result = context.run(command, timeout=240 if gpu else 120)
    if result.returncode:
        raise RuntimeError(f"bare megatron-core loop exited {result.returncode}")
    line = [ln for ln in result.stdout.splitlines() if ln.startswith("seconds_per_step ")][-1]
    return float(line.split()[1])


def transformer_engine() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001  (absent or broken: the TE runs are not made)
        return False
    return True


def training(context: Context) -> dict:
    """gpt3/126m (rehearsal: gpt3/tiny, fp32, CPU) through main.py: the loss falls; tokens/s,
    model TFLOP/s and its fraction of the matmul ceiling; the bare megatron-core loop's step time
    on the same recipe (overhead goal <= 1.03); then the TE spec and FP8 where TE imports."""
    gpu = on_gpu(context)
    prepare_data(context)
    ours = train_once(context, "gpt-train", gpu, [])
    figures = {k: v for k, v in ours.items() if k != "overrides"}
    roof = context.earlier("ceiling").get("figures", {}).get("matmul_tflops")
    if roof:
        figures["fraction_of_ceiling"] = round(ours["model_tflops_per_gpu"] / roof, 4)
    recipe = write_recipe(ours["overrides"], context.work / "gpt-train.yaml")
    bare = bare_step_s(context, recipe, gpu)
    figures["bare_step_s"] = round(bare, 5)
    figures["overhead_ratio"] = round(ours["step_s"] / bare, 4)
    figures["overhead_goal_met"] = figures["overhead_ratio"] <= 1.03
    reasons = []
    if gpu and transformer_engine():
        te = ["training.model.transformer_engine=true"]
        for name, extra in (("te", te), ("te-fp8", [*te, "training.model.fp8=true"])):
            try:
                run = train_once(context, f"gpt-{name}", gpu, extra)
                figures[f"{name}_tokens_per_s"] = run["tokens_per_s"]
                figures[f"{name}_loss_falls"] = run["loss_falls"]
            except Exception as error:  # noqa: BLE001  (reported; the bf16 figures stand)
                reasons.append(f"{name}: {error}")
    else:
        figures["transformer_engine"] = "not importable" if gpu else "not tried on CPU"
    if context.rehearse:
        # The GPU run's command, planned and checked (dry run) so that it cannot rot unseen.
        gpu_overrides = training_overrides(context, context.work / "gpu-plan", gpu=True)
        command = [sys.executable, "main.py", "stages=[training]", "cluster_type=local"]
        planned = context.run([*command, "dry_run=true", *gpu_overrides], timeout=120)
        figures["gpu_recipe_dry_run"] = "passed" if planned.returncode == 0 else "failed"
        if planned.returncode:
            reasons.append(f"the GPU recipe's dry run exited {planned.returncode}")
    if not ours["loss_falls"]:
        reasons.append("the loss did not fall")
    record = {"status": "failed" if reasons else "passed", "figures": figures}
    if reasons:
        record["reason"] = "; ".join(reasons)
    return record


# --- the memory model ------------------------------------------------------------------------

# A GPT of about 1.3 B parameters (gpt3/126m's recipe, wider and deeper); each layout's micro
# batch is the largest whose planned memory is at most MEMORY_FILL of the GPU's.
MEMORY_MODEL = [
    "training.model.num_layers=24",
    "training.model.hidden_size=2048",
    "training.model.ffn_hidden_size=8192",
    "training.model.num_attention_heads=16",
]
MEMORY_FILL = 0.75
MEMORY_GOAL = 0.10  # |plan - measured| / measured
RECOMPUTE = "training.model.activations_checkpoint_"
LAYOUTS: dict[str, list[str]] = {
    "seq2048": [],
    "seq2048-selective": [f"{RECOMPUTE}granularity=selective"],
    "seq4096-full-uniform": [
        f"{RECOMPUTE}granularity=full",
        f"{RECOMPUTE}method=uniform",
        f"{RECOMPUTE}num_layers=1",
    ],
    "seq2048-full-block-half": [
        f"{RECOMPUTE}granularity=full",
        f"{RECOMPUTE}method=block",
        f"{RECOMPUTE}num_layers=12",
    ],
}
MEMORY_STEPS = 3


def layout_overrides(context: Context, name: str, micro: int, gpu: bool) -> list[str]:
    seq = 4096 if name.startswith("seq4096") else 2048
    log_dir = context.work / f"memory-{name}"
    base = training_overrides(context, log_dir, gpu=True) + MEMORY_MODEL + LAYOUTS[name]
    base += [
        f"training.model.micro_batch_size={micro}",
        f"training.model.global_batch_size={micro}",
        f"training.model.encoder_seq_length={seq}",
        f"training.model.max_position_embeddings={seq}",
        f"training.trainer.max_steps={MEMORY_STEPS}",
        f"training.trainer.val_check_interval={MEMORY_STEPS + 1}",
        f"training.exp_manager.checkpoint_callback_params.every_n_train_steps={MEMORY_STEPS + 1}",
        "training.model.optim.sched.warmup_steps=1",
    ]
    if gpu:
        return base
    # The rehearsal trains gpt3/tiny's shape, fp32 on CPU, with the layout's batch and sequence.
    return [
        *base,
        "training.trainer.accelerator=cpu",
        "training.trainer.precision=32",
        "training.model.num_layers=2",
        "training.model.hidden_size=64",
        "training.model.ffn_hidden_size=256",
        "training.model.num_attention_heads=4",
        f"training.model.encoder_seq_length={seq // 16}",
        f"training.model.max_position_embeddings={seq // 16}",
    ]


def planned_gib(overrides: list[str]) -> float:
    """The plan's memory per GPU (launcher_scripts/costmodel/memory.py through the family)."""
    from launcher_scripts.config.compose import compose_config
    from launcher_scripts.families import family_of

    root = compose_config(["stages=[training]", *overrides])
    return family_of(root, "training").plan(root, "training").memory.total_gib


def largest_micro_batch(context: Context, name: str, gpu_gib: float) -> tuple[int, float]:
    micro, plan = 1, planned_gib(layout_overrides(context, name, 1, True))
    for candidate in (2, 4, 8, 16, 32, 64):
        bigger = planned_gib(layout_overrides(context, name, candidate, True))
        if bigger > MEMORY_FILL * gpu_gib:
            break
        micro, plan = candidate, bigger
    return micro, plan


def memory(context: Context) -> dict:
    """The plan's memory per GPU against torch.cuda.max_memory_allocated, per layout (the
    training program's peak_memory_gb on the GPU). Rehearsal: each layout's GPU command is
    planned and dry-run, and the layouts without recomputation (refused on CPU) train tiny."""
    import torch

    gpu = on_gpu(context)
    prepare_data(context)
    figures: dict = {}
    reasons = []
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if gpu else 80.0
    # Rehearsal: the micro batches are planned for an 80 GiB GPU (an assumption, not measured).
    figures["gpu_memory_gib" if gpu else "assumed_gpu_memory_gib"] = round(gpu_gib, 1)
    command = [sys.executable, "main.py", "stages=[training]", "cluster_type=local"]
    for name in LAYOUTS:
        try:
            micro, plan = largest_micro_batch(context, name, gpu_gib)
            gpu_command = [*command, *layout_overrides(context, name, micro, True)]
            if not gpu:
                planned = context.run([*gpu_command, "dry_run=true"], timeout=120)
                figures[f"{name}_dry_run"] = "passed" if planned.returncode == 0 else "failed"
                if planned.returncode:
                    reasons.append(f"{name}: the dry run exited {planned.returncode}")
                figures[f"{name}_plan_gib"] = round(plan, 2)
                figures[f"{name}_micro_batch"] = micro
                if RECOMPUTE in " ".join(LAYOUTS[name]):
                    continue  # recomputation needs CUDA
                gpu_command = [*command, *layout_overrides(context, name, 2, False)]
            result = context.run(gpu_command, timeout=240 if gpu else 60)
            if result.returncode:
                reasons.append(f"{name}: training exited {result.returncode}")
                continue
            log_dir = context.work / f"memory-{name}"
            peak = max(r["peak_memory_gb"] for r in records(log_dir) if "peak_memory_gb" in r)
            if gpu:
                error = (plan - peak) / peak
                figures.update({f"{name}_micro_batch": micro, f"{name}_plan_gib": round(plan, 2)})
                figures[f"{name}_measured_gib"] = round(peak, 2)
                figures[f"{name}_error"] = round(error, 4)
                if abs(error) > MEMORY_GOAL:
                    reasons.append(f"{name}: plan off by {error:+.1%} (goal {MEMORY_GOAL:.0%})")
            else:
                figures[f"{name}_cpu_trained"] = True  # peak RSS is no GPU memory: not compared
        except Exception as error:  # noqa: BLE001  (this layout fails; the next one runs)
            reasons.append(f"{name}: {type(error).__name__}: {error}")
    record = {"status": "failed" if reasons else "passed", "figures": figures}
    if reasons:
        record["reason"] = "; ".join(reasons)
    return record


# --- recomputation and context parallelism ---------------------------------------------------

RECOMPUTE_SETTINGS: dict[str, list[str]] = {
    "none": [],
    "selective": [f"{RECOMPUTE}granularity=selective"],
    "full": [
        f"{RECOMPUTE}granularity=full",
        f"{RECOMPUTE}method=uniform",
        f"{RECOMPUTE}num_layers=1",
    ],
}


def recompute(context: Context) -> dict:
    """The memory model's GPT at one micro batch (2, sequence 2048) without, with selective and
    with full recomputation: each trains, and the measured peak falls in the order the plan
    says. Context parallelism needs two GPUs: with one it is reported skipped. Rehearsal:
    recomputation is refused on CPU, so each GPU command is planned and dry-run."""
    gpu = on_gpu(context)
    prepare_data(context)
    figures: dict = {}
    reasons = []
    command = [sys.executable, "main.py", "stages=[training]", "cluster_type=local"]
    for name, extra in RECOMPUTE_SETTINGS.items():
        overrides = layout_overrides(context, "seq2048", 2, True) + extra
        overrides = [o.replace("memory-seq2048", f"recompute-{name}") for o in overrides]
        figures[f"{name}_plan_gib"] = round(planned_gib(overrides), 2)
        if not gpu:
            planned = context.run([*command, "dry_run=true", *overrides], timeout=120)
            figures[f"{name}_dry_run"] = "passed" if planned.returncode == 0 else "failed"
            if planned.returncode:
                reasons.append(f"{name}: the dry run exited {planned.returncode}")
            continue
        result = context.run([*command, *overrides], timeout=240)
        if result.returncode:
            reasons.append(f"{name}: training exited {result.returncode}")
            continue
        peaks = records(context.work / f"recompute-{name}")
        figures[f"{name}_measured_gib"] = round(max(r["peak_memory_gb"] for r in peaks), 2)
        figures[f"{name}_loss_last"] = round(peaks[-1]["reduced_train_loss"], 4)
    if gpu and not reasons:
        measured = [figures[f"{name}_measured_gib"] for name in RECOMPUTE_SETTINGS]
        planned = [figures[f"{name}_plan_gib"] for name in RECOMPUTE_SETTINGS]
        figures["measured_falls"] = measured[0] > measured[1] > measured[2]
        figures["plan_falls"] = planned[0] > planned[1] > planned[2]
        if not figures["measured_falls"]:
            reasons.append(f"the measured peak does not fall none > selective > full: {measured}")
    import torch

    gpus = torch.cuda.device_count() if gpu else 0
    figures["context_parallel"] = "not run: needs 2 GPUs" if gpus < 2 else "not written yet"
    record = {"status": "failed" if reasons else "passed", "figures": figures}
    if reasons:
        record["reason"] = "; ".join(reasons)
    return record


# --- T5 and BERT ----------------------------------------------------------------------------

ENCODER_STEPS_GPU, ENCODER_STEPS_CPU = 50, 12


def encoders(context: Context) -> dict:
    """t5/tiny and bert/tiny through main.py (their data preparation, then training): bf16 on
    the GPU, fp32 on CPU in the rehearsal; each runs and its loss falls."""
    gpu = on_gpu(context)
    steps = ENCODER_STEPS_GPU if gpu else ENCODER_STEPS_CPU
    figures: dict = {}
    reasons = []
    for family in ("t5", "bert"):
        work = context.work / family
        log_dir = work / "log"
        overrides = [
            f"training={family}/tiny",
            f"data_dir={work}/data",
            f"base_results_dir={work}/results",
            f"training.exp_manager.explicit_log_dir={log_dir}",
            "training.exp_manager.resume_if_exists=false",
            f"training.trainer.max_steps={steps}",
            "training.trainer.log_every_n_steps=1",
            f"training.trainer.val_check_interval={steps + 1}",
            f"training.exp_manager.checkpoint_callback_params.every_n_train_steps={steps + 1}",
        ]
        overrides += ["training.model.optim.sched.warmup_steps=2"] if family == "bert" else []
        if gpu:
            overrides += ["training.trainer.accelerator=gpu", "training.trainer.precision=bf16"]
        stages = "stages=[data_preparation,training]"
        result = context.run([sys.executable, "main.py", stages, *overrides], timeout=240)
        if result.returncode:
            reasons.append(f"{family}: main.py exited {result.returncode}")
            continue
        logged = [r for r in records(log_dir) if "reduced_train_loss" in r]
        first, last = logged[0]["reduced_train_loss"], logged[-1]["reduced_train_loss"]
        figures[f"{family}_steps"] = len(logged)
        figures[f"{family}_loss_first"] = round(first, 4)
        figures[f"{family}_loss_last"] = round(last, 4)
        figures[f"{family}_tokens_per_s"] = round(
            statistics.median(r["tokens_per_sec"] for r in logged[len(logged) // 2 :])
        )
        if not last < first:
            reasons.append(f"{family}: the loss did not fall ({first:.3f} -> {last:.3f})")
        if not gpu:
            # The GPU run's training command, planned and checked on the data just prepared.
            gpu_only = ["training.trainer.accelerator=gpu", "training.trainer.precision=bf16"]
            command = [sys.executable, "main.py", "stages=[training]", "dry_run=true"]
            planned = context.run([*command, *overrides, *gpu_only], timeout=120)
            figures[f"{family}_gpu_dry_run"] = "passed" if planned.returncode == 0 else "failed"
            if planned.returncode:
                reasons.append(f"{family}: the GPU command's dry run exited {planned.returncode}")
    record = {"status": "failed" if reasons else "passed", "figures": figures}
    if reasons:
        record["reason"] = "; ".join(reasons)
    return record


# --- mixture of experts -----------------------------------------------------------------------

MOE_STEPS_GPU, MOE_STEPS_CPU = 60, 10


def moe(context: Context) -> dict:
    """gpt3/tiny_moe through main.py: on the GPU in bf16, with Transformer Engine's MoE layers
    and grouped GEMM where it imports (megatron-core's local layers otherwise; fp32 on CPU in
    the rehearsal). The loss falls, the routing losses and the experts' load are logged, and
    tokens/s is recorded."""
    gpu = on_gpu(context)
    prepare_data(context)
    steps = MOE_STEPS_GPU if gpu else MOE_STEPS_CPU
    log_dir = context.work / "moe" / "log"
    overrides = [
        "training=gpt3/tiny_moe",
        f"data_dir={context.work}/data",
        f"base_results_dir={context.work}/moe",
        f"training.exp_manager.explicit_log_dir={log_dir}",
        "training.exp_manager.resume_if_exists=false",
        f"training.trainer.max_steps={steps}",
        "training.trainer.log_every_n_steps=1",
        f"training.trainer.val_check_interval={steps + 1}",
        f"training.exp_manager.checkpoint_callback_params.every_n_train_steps={steps + 1}",
        "training.model.optim.sched.warmup_steps=2",
    ]
    te = gpu and transformer_engine()
    if gpu:
        overrides += ["training.trainer.accelerator=gpu", "training.trainer.precision=bf16"]
    if te:
        overrides += [
            "training.model.transformer_engine=true",
            "training.model.moe_grouped_gemm=true",
        ]
    result = context.run([sys.executable, "main.py", "stages=[training]", *overrides], timeout=240)
    if result.returncode:
        return {"status": "failed", "reason": f"main.py exited {result.returncode}", "figures": {}}
    logged = [r for r in records(log_dir) if "reduced_train_loss" in r]
    first, last = logged[0]["reduced_train_loss"], logged[-1]["reduced_train_loss"]
    figures = {
        "transformer_engine": te,
        "steps": len(logged),
        "loss_first": round(first, 4),
        "loss_last": round(last, 4),
        "load_balancing_loss_last": round(logged[-1]["moe_load_balancing_loss"], 4),
        "expert_load_max_last": round(logged[-1]["moe_load_max"], 3),
        "tokens_per_s": round(
            statistics.median(r["tokens_per_sec"] for r in logged[len(logged) // 2 :])
        ),
    }
    reasons = [] if last < first else [f"the loss did not fall ({first:.3f} -> {last:.3f})"]
    record = {"status": "failed" if reasons else "passed", "figures": figures}
    if reasons:
        record["reason"] = "; ".join(reasons)
    return record


# --- conversion -------------------------------------------------------------------------------


def conversion(context: Context) -> dict:
    """The training step's last checkpoint through main.py's conversion stage (gpt3/convert_gpt3:
    the portable file and the Hugging Face export); transformers then loads the export in bf16
    on the device (fp32 on CPU in the rehearsal) and its logits for a few tokens are finite."""
    import torch

    gpu = on_gpu(context)
    trained = context.work / "gpt-train"
    if not (trained / "checkpoints").is_dir():
        return {"status": "failed", "reason": "the training step left no checkpoint"}
    output = context.work / "converted"
    overrides = training_overrides(context, trained, gpu)
    command = [sys.executable, "main.py", "stages=[conversion]", "cluster_type=local"]
    command += ["conversion=gpt3/convert_gpt3", *overrides]
    command += [
        f"conversion.model.checkpoint_folder={trained}/checkpoints",
        f"conversion.model.hparams_file={trained}/hparams.yaml",
        f"conversion.run.output_path={output}",
    ]
    result = context.run(command, timeout=180)
    if result.returncode:
        return {"status": "failed", "reason": f"main.py exited {result.returncode}"}
    figures = {"nemo_mb": round((output / "megatron_gpt.nemo").stat().st_size / 1e6, 1)}
    from transformers import AutoModelForCausalLM

    dtype, device = (torch.bfloat16, "cuda") if gpu else (torch.float32, "cpu")
    context.commands.append(f"AutoModelForCausalLM.from_pretrained({output / 'hf'}, {dtype})")
    model = AutoModelForCausalLM.from_pretrained(output / "hf", torch_dtype=dtype).to(device)
    tokens = torch.arange(1, 17, device=device).unsqueeze(0)
    with torch.no_grad():
        logits = model(tokens).logits
    figures["hf_dtype"] = str(next(model.parameters()).dtype).split(".")[-1]
    figures["hf_logits_finite"] = bool(torch.isfinite(logits).all())
    passed = figures["hf_logits_finite"]
    record = {"status": "passed" if passed else "failed", "figures": figures}
    if not passed:
        record["reason"] = "the Hugging Face export's logits are not finite"
    return record


# --- generation -------------------------------------------------------------------------------

PROMPTS = ("The history of", "In the morning the", "A small village near the river", "We like")


def generation(context: Context) -> dict:
    """The conversion step's portable file served in this process (the serving runner:
    jobs/inference/served.py, on the GPU when there is one) generating greedily through its KV
    cache: 8 prompts x 32 new tokens at batch 8 (rehearsal: 4 x 8 on CPU), generated tokens/s;
    then 16 requests (rehearsal: 8) through the model server's in-flight loop, all at once
    against one at a time."""
    gpu = on_gpu(context)
    model_file = converted_model(context)
    from launcher_scripts.jobs.inference.generation import GenerationParams, generate
    from launcher_scripts.jobs.inference.runner import close_runner
    from launcher_scripts.jobs.inference.served import open_served

    prompts_n, tokens = (8, 32) if gpu else (4, 8)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(prompts_n)]
    context.commands.append(
        f"open_served({model_file}, on_gpu={gpu}); generate {prompts_n} prompts x {tokens} "
        "tokens, greedy, one batch"
    )
    served = open_served(model_file, on_gpu=gpu)
    try:
        params = GenerationParams(tokens_to_generate=tokens, top_k=1)
        run = partial(generate, served.decoding, served.tokenizer, prompts, params)
        run(max_length=served.max_length)  # the first call pays for lazy set-up
        start = time.perf_counter()
        completions = run(max_length=served.max_length)
        seconds = time.perf_counter() - start
        in_flight = served_in_flight(served, prompts_n * 2, tokens)
    finally:
        close_runner()
    generated = sum(len(c.tokens) for c in completions)
    figures = {"on_gpu": served.on_gpu, "generated_tokens": generated}
    figures["tokens_per_s"] = round(generated / seconds, 1)
    figures.update(in_flight)
    passed = generated > 0 and served.on_gpu == gpu
    record = {"status": "passed" if passed else "failed", "figures": figures}
    if not passed:
        record["reason"] = "no tokens generated, or not on the expected device"
    return record


def served_in_flight(served: object, clients: int, tokens: int) -> dict:
    """`clients` one-prompt requests through the in-flight loop the model server runs
    (engine_loop.py): all at once against one at a time, tokens/s of each."""
    from launcher_scripts.jobs.inference.engine_loop import EngineLoop
    from launcher_scripts.jobs.inference.generation import GenerationParams

    params = GenerationParams(tokens_to_generate=tokens, top_k=1)
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(clients)]
    loop = EngineLoop(served.decoding, served.tokenizer, clients, served.max_length)
    try:
        loop.submit(texts[:1], params).result()  # set-up
        start = time.perf_counter()
        answers = [loop.submit([text], params).result() for text in texts]
        one = time.perf_counter() - start
        start = time.perf_counter()
        futures = [loop.submit([text], params) for text in texts]
        for future in futures:
            future.result()
        many = time.perf_counter() - start
    finally:
        loop.close()
    generated = sum(len(answer[0].tokens) for answer in answers)
    return {
        "in_flight_clients": clients,
        "one_at_a_time_tokens_per_s": round(generated / one, 1),
        "in_flight_tokens_per_s": round(generated / many, 1),
        "in_flight_ratio": round(one / many, 2),
    }


# --- evaluation -------------------------------------------------------------------------------

EVAL_BATCH = 8


@dataclass
class OfflineRequests:
    """The shipped offline tasks as lm-eval requests: tiny_choice's (query, " " + choice) pairs,
    then tiny_lambada's (text but its last word, " " + that word) pairs; tiny_wikitext's texts."""

    pairs: list[tuple[str, str]] = field(default_factory=list)
    questions: list[tuple[range, int]] = field(default_factory=list)  # choices' pairs, gold
    lambada: range = range(0)
    documents: list[str] = field(default_factory=list)


def offline_requests() -> OfflineRequests:
    from launcher_scripts.jobs.evaluation.offline_data import read_jsonl

    requests = OfflineRequests()
    for row in read_jsonl("tiny_choice.jsonl"):
        first = len(requests.pairs)
        requests.pairs += [(row["query"], " " + choice) for choice in row["choices"]]
        requests.questions.append((range(first, len(requests.pairs)), int(row["label"])))
    first = len(requests.pairs)
    for row in read_jsonl("tiny_lambada.jsonl"):
        *words, last = row["text"].split(" ")
        requests.pairs.append((" ".join(words), " " + last))
    requests.lambada = range(first, len(requests.pairs))
    requests.documents = [row["page"] for row in read_jsonl("tiny_wikitext.jsonl")]
    return requests


def picked_choices(requests: OfflineRequests, logprobs: list[float]) -> list[int]:
    """Each question's choice of highest log-likelihood (lm-eval's acc)."""
    return [max(span, key=logprobs.__getitem__) - span.start for span, _ in requests.questions]


def reference_logprobs(
    hf_dir: Path, rows: list[tuple[list[int], list[int]]], vocab: int, gpu: bool
) -> list[float]:
    """transformers' log-probability of each continuation after its context, on the device
    and in the dtype of the run (bf16 on the GPU, fp32 on CPU). Normalised over the
    tokenizer's `vocab` ids, as the serving runner's are: the export keeps the rows that pad
    the vocabulary to a multiple of make_vocab_size_divisible_by, which no text can hold."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype, device = (torch.bfloat16, "cuda") if gpu else (torch.float32, "cpu")
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=dtype).to(device).eval()
    scores = []
    with torch.no_grad():
        for context, continuation in rows:
            tokens = torch.tensor([(context + continuation)[:-1]], device=device)
            logits = model(tokens).logits[0, -len(continuation) :, :vocab].float()
            target = torch.tensor(continuation, device=device).unsqueeze(-1)
            picked = torch.log_softmax(logits, dim=-1).gather(-1, target)
            scores.append(float(picked.double().sum()))
    return scores


def evaluation(context: Context) -> dict:
    """The evaluation job's model side on the device: its lm-eval adapter (MegatronLM over the
    serving runner) scores the shipped offline tasks (multiple choice, last word, rolling
    perplexity) from the conversion step's portable file, and every log-likelihood is compared
    with transformers' on the Hugging Face export (same device and dtype). Then main.py's
    evaluation stage runs the offline tasks where lm-eval's evaluator imports (datasets needs
    the machine's pyarrow); in the rehearsal that command is dry-run."""
    gpu = on_gpu(context)
    model_file = converted_model(context)
    converted = model_file.parent
    from lm_eval.api.instance import Instance

    from launcher_scripts.jobs.evaluation.lm_adapter import MegatronLM
    from launcher_scripts.jobs.inference.runner import close_runner, open_runner

    requests = offline_requests()
    context.commands.append(
        f"MegatronLM(open_runner({model_file}, on_gpu={gpu}), batch_size={EVAL_BATCH}): "
        f"loglikelihood x {len(requests.pairs)}, loglikelihood_rolling x {len(requests.documents)}"
    )
    runner = open_runner(model_file, 1, 1, on_gpu=gpu)
    try:
        adapter = MegatronLM(runner, EVAL_BATCH, progress=False)
        asked = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(requests.pairs)]
        adapter.loglikelihood(asked[:EVAL_BATCH])  # the first call pays for lazy set-up
        start = time.perf_counter()
        scored = adapter.loglikelihood(asked)
        seconds = time.perf_counter() - start
        documents = requests.documents
        rolling = adapter.loglikelihood_rolling(
            [Instance("loglikelihood_rolling", {}, (doc,), i) for i, doc in enumerate(documents)]
        )
        encoded = [adapter.encode_pair(*pair) for pair in requests.pairs]
    finally:
        close_runner()
    ours = [logprob for logprob, _ in scored]
    picks = picked_choices(requests, ours)
    gold = [label for _, label in requests.questions]
    words = sum(len(doc.split()) for doc in documents)
    figures: dict = {"on_gpu": runner.on_gpu, "requests": len(asked)}
    figures["requests_per_s"] = round(len(asked) / seconds, 1)
    right = [pick == label for pick, label in zip(picks, gold, strict=True)]
    figures["choice_acc"] = round(statistics.mean(right), 4)
    figures["lambada_acc"] = round(statistics.mean(scored[i][1] for i in requests.lambada), 4)
    figures["wikitext_word_perplexity"] = round(math.exp(-sum(rolling) / words), 3)
    # transformers on the same token rows: the per-token log-probabilities must agree.
    context.commands.append(f"AutoModelForCausalLM.from_pretrained({converted / 'hf'}): same rows")
    rows = [(item.context, item.continuation) for item in encoded]
    reference = reference_logprobs(converted / "hf", rows, runner.vocab_size, gpu)
    per_token = [
        abs(a - b) / len(item.continuation)
        for a, b, item in zip(ours, reference, encoded, strict=True)
    ]
    figures["vs_transformers_mean_token_diff"] = round(statistics.mean(per_token), 6)
    figures["vs_transformers_max_token_diff"] = round(max(per_token), 6)
    agree = zip(picks, picked_choices(requests, reference), strict=True)
    figures["vs_transformers_choice_agreement"] = round(
        statistics.mean(a == b for a, b in agree), 4
    )
    reasons = []
    # bf16 rounds differently in the two implementations; in fp32 they must agree closely.
    limit = EVAL_TOKEN_DIFF_BF16 if gpu else EVAL_TOKEN_DIFF_FP32
    if figures["vs_transformers_mean_token_diff"] > limit:
        reasons.append(
            f"log-probs differ from transformers' by {statistics.mean(per_token):.4f} per token "
            f"on average (limit {limit})"
        )
    figures["harness"] = harness(context, model_file, gpu, reasons)
    record = {"status": "failed" if reasons else "passed", "figures": figures}
    if reasons:
        record["reason"] = "; ".join(reasons)
    return record


EVAL_TOKEN_DIFF_BF16 = 0.05  # nats per token, mean over the requests
EVAL_TOKEN_DIFF_FP32 = 1e-4


def harness(context: Context, model_file: Path, gpu: bool, reasons: list[str]) -> str:
    """main.py's evaluation stage on the offline tasks, where lm-eval's evaluator imports."""
    command = [sys.executable, "main.py", "stages=[evaluation]", "cluster_type=local"]
    command += training_overrides(context, context.work / "evaluation-train", gpu)
    command += [
        "evaluation=gpt3/evaluate_all",
        f"evaluation.model.nemo_model={model_file}",
        f"evaluation.run.results_dir={context.work / 'evaluation'}",
        "evaluation.run.limit=10",
        "evaluation.run.bootstrap_iters=0",
    ]
    try:
        import datasets  # noqa: F401
        import lm_eval.evaluator  # noqa: F401
    except ImportError:
        importable = False
    else:
        importable = True
    if context.rehearse or not importable:
        planned = context.run([*command, "dry_run=true"], timeout=120)
        if planned.returncode:
            reasons.append(f"the evaluation stage's dry run exited {planned.returncode}")
        outcome = "dry run passed" if planned.returncode == 0 else "dry run failed"
        return outcome + ("" if importable else "; not run: lm-eval's evaluator does not import")
    result = context.run(command, timeout=180)
    if result.returncode:
        reasons.append(f"the evaluation stage exited {result.returncode}")
        return "failed"
    results = json.loads((context.work / "evaluation" / "results.json").read_text())["results"]
    shown = []
    for task, metrics in sorted(results.items()):
        for name, value in metrics.items():
            if isinstance(value, float) and "stderr" not in name:
                shown.append(f"{task} {name.split(',')[0]}={value:.4f}")
                break
    return "ran: " + ", ".join(shown)


# --- fine-tuning and PEFT -------------------------------------------------------------------

TUNE_STEPS_GPU, TUNE_STEPS_CPU = 40, 10
TUNING: dict[str, list[str]] = {  # stage -> its overrides besides the shared ones
    "fine_tuning": ["fine_tuning.model.optim.lr=1e-4"],
    "peft": [
        "peft.model.peft.peft_scheme=lora",
        "peft.model.peft.lora_tuning.adapter_dim=16",
        "peft.model.optim.lr=1e-3",
    ],
}


def tuning_overrides(context: Context, stage: str, base: Path, task: dict, gpu: bool) -> list[str]:
    """SFT or LoRA on the tests' word-mapping task (tests/support/sft_task.py): one device,
    validation at step 0 and at the end, bf16 on the GPU (fp32 on CPU in the rehearsal)."""
    steps = TUNE_STEPS_GPU if gpu else TUNE_STEPS_CPU
    data = f"{stage}.model.data"
    overrides = [
        f"stages=[{stage}]",
        "cluster_type=local",
        f"base_results_dir={context.work}/results",
        f"{stage}.exp_manager.explicit_log_dir={context.work / f'tuned-{stage}'}",
        f"{stage}.exp_manager.resume_if_exists=false",
        f"{stage}.model.restore_from_path={base}",
        f"{data}.train_ds.file_names=[{task['train']}]",
        f"{data}.validation_ds.file_names=[{task['val']}]",
        f"{data}.test_ds.file_names=[{task['test']}]",
        f"{data}.train_ds.max_seq_length=32",
        f"{data}.validation_ds.tokens_to_generate=1",  # the answers are single tokens
        f"{data}.test_ds.tokens_to_generate=1",
        f"{stage}.trainer.devices=1",
        f"{stage}.trainer.max_steps={steps}",
        f"{stage}.trainer.val_check_interval={steps}",
        f"{stage}.trainer.log_every_n_steps=1",
        f"{stage}.model.global_batch_size=8",
        f"{stage}.model.micro_batch_size=8",
        f"{stage}.model.hidden_dropout=0.0",
        f"{stage}.model.attention_dropout=0.0",
        f"{stage}.model.optim.sched.warmup_steps=2",
        *TUNING[stage],
    ]
    if gpu:
        return [*overrides, f"{stage}.trainer.accelerator=gpu", f"{stage}.trainer.precision=bf16"]
    return [*overrides, f"{stage}.trainer.accelerator=cpu", f"{stage}.trainer.precision=32"]


def finetuning(context: Context) -> dict:
    """Full fine-tuning (SFT) and LoRA of the conversion step's portable file through main.py's
    fine_tuning and peft stages: each trains and its validation loss falls; step time, and the
    size of the LoRA file."""
    gpu = on_gpu(context)
    base = converted_model(context)
    import tempfile

    import launcher_scripts.families  # noqa: F401  (registers the shapes the file reader checks)
    from launcher_scripts.formats import portable
    from launcher_scripts.jobs.inference.text_tokenizer import load_text_tokenizer
    from tests.support.sft_task import write_task

    with tempfile.TemporaryDirectory() as scratch:
        model = portable.read(base, Path(scratch))
        tokenizer = load_text_tokenizer(model.config.tokenizer)
        task = write_task(context.work / "sft-task", tokenizer, model.tensors[EMBEDDING])
    figures: dict = {}
    reasons = []
    for stage in TUNING:
        name = "sft" if stage == "fine_tuning" else "lora"
        command = [sys.executable, "main.py", *tuning_overrides(context, stage, base, task, gpu)]
        result = context.run(command, timeout=240)
        if result.returncode:
            reasons.append(f"{name}: main.py exited {result.returncode}")
            continue
        log_dir = context.work / f"tuned-{stage}"
        logged = records(log_dir)
        validation = [(r["step"], r["val_loss"]) for r in logged if "val_loss" in r]
        train = [r for r in logged if "reduced_train_loss" in r]
        (first_step, before), (last_step, after) = validation[0], validation[-1]
        figures[f"{name}_val_loss"] = (
            f"{before:.4f} (step {first_step}) -> {after:.4f} (step {last_step})"
        )
        times = [r["wall_time"] for r in train]
        figures[f"{name}_step_s"] = round(statistics.median(b - a for a, b in pairwise(times)), 5)
        if "peak_memory_gb" in train[-1]:
            figures[f"{name}_peak_memory_gb"] = round(max(r["peak_memory_gb"] for r in train), 3)
        if stage == "peft":
            written = sorted((log_dir / "checkpoints").glob("*.nemo"))
            figures["lora_file_mb"] = (
                round(written[-1].stat().st_size / 1e6, 3) if written else None
            )
        if not (first_step == 0 and after < before):
            reasons.append(
                f"{name}: the validation loss did not fall ({before:.3f} -> {after:.3f})"
            )
    record = {"status": "failed" if reasons else "passed", "figures": figures}
    if reasons:
        record["reason"] = "; ".join(reasons)
    return record


EMBEDDING = "embedding.word_embeddings.weight"


# --- the vLLM repository ----------------------------------------------------------------------

VLLM_TOKENS = 32


def vllm_step(context: Context) -> dict:
    """main.py's export with `export.vllm.enabled=true` on the conversion step's file and its
    Hugging Face export; then, where vLLM imports, its engine built from the repository's
    model.json (the arguments Triton's vllm backend passes it) generates greedily, and its
    tokens are compared with our engine's on the same file (the first token of each prompt must
    agree in bf16; the share of all tokens that agree is recorded)."""
    gpu = on_gpu(context)
    model_file = converted_model(context)
    hf_dir = model_file.parent / "hf"
    results = context.work / "vllm-export"
    command = [sys.executable, "main.py", "stages=[export]", "cluster_type=local"]
    command += [f"base_results_dir={results}", f"export.model.nemo_file={model_file}"]
    command += ["export.vllm.enabled=true", f"export.vllm.hf_dir={hf_dir}"]
    command += ["export.vllm.gpu_memory_utilization=0.3"]
    result = context.run(command, timeout=240)
    if result.returncode:
        return {"status": "failed", "reason": f"main.py exited {result.returncode}"}
    found = sorted(results.glob("*/export/model_repo_vllm/*/1/model.json"))
    if not found:
        return {"status": "failed", "reason": "the export wrote no model_repo_vllm/*/1/model.json"}
    args = json.loads(found[0].read_text())
    figures: dict = {"engine_args": sorted(args)}
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise StepEnds(
            "skipped",
            "the repository is written (model.json checked by the export); vLLM is not "
            "installed here, and its wheels (hundreds of MB with their CUDA kernels) exceed "
            "what the device tool carries",
        ) from None
    if not gpu:
        raise StepEnds("skipped", "vLLM needs CUDA")
    from vllm import LLM, SamplingParams

    from launcher_scripts.jobs.inference.generation import GenerationParams, generate
    from launcher_scripts.jobs.inference.runner import close_runner
    from launcher_scripts.jobs.inference.served import open_served

    prompts = list(PROMPTS)
    context.commands.append(f"vllm.LLM(**{found[0]}); greedy {VLLM_TOKENS} tokens")
    engine = LLM(**args)
    start = time.perf_counter()
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=VLLM_TOKENS))
    seconds = time.perf_counter() - start
    theirs = [list(output.outputs[0].token_ids) for output in outputs]
    del engine
    served = open_served(model_file, on_gpu=True)
    try:
        params = GenerationParams(tokens_to_generate=VLLM_TOKENS, top_k=1)
        ours = [
            c.tokens
            for c in generate(
                served.decoding, served.tokenizer, prompts, params, max_length=served.max_length
            )
        ]
    finally:
        close_runner()
    pairs = [
        (a, b)
        for mine, reference in zip(ours, theirs, strict=True)
        for a, b in zip(mine, reference, strict=False)  # either may end early (eod)
    ]
    figures["vllm_tokens_per_s"] = round(sum(len(t) for t in theirs) / seconds, 1)
    figures["first_tokens_agree"] = all(m[:1] == t[:1] for m, t in zip(ours, theirs, strict=True))
    figures["tokens_agreeing"] = round(sum(a == b for a, b in pairs) / max(1, len(pairs)), 3)
    passed = figures["first_tokens_agree"]
    record = {"status": "passed" if passed else "failed", "figures": figures}
    if not passed:
        record["reason"] = "vLLM's first greedy token differs from our engine's"
    return record


# --- cluster validation's GPU probe -----------------------------------------------------------


def probe(context: Context) -> dict:
    """csp_tools.validation.node_probe on this node: on the GPU its bf16 matmul and copy bandwidth
    against the published figures and against this run's ceiling; on CPU its CPU checks."""
    gpu = on_gpu(context)
    command = [sys.executable, "-m", "csp_tools.validation.node_probe"]
    command += ["--expect-gpus", "1"] if gpu else []
    result = context.run(command, timeout=180)
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"status": "failed", "reason": f"no report (exit {result.returncode})"}
    report = json.loads(lines[-1])
    figures = {}
    for check in report["checks"]:
        figures[check["name"]] = check["value"] if check["value"] is not None else check["status"]
        if check.get("limit") is not None:
            figures[f"{check['name']}_limit"] = check["limit"]
    roof = context.earlier("ceiling").get("figures", {}).get("matmul_tflops")
    matmul = next((c["value"] for c in report["checks"] if c["name"].startswith("matmul")), None)
    if roof and matmul:
        figures["probe_matmul_over_ceiling"] = round(matmul / roof, 4)
    failed = [c["name"] for c in report["checks"] if c["status"] == "fail"]
    record = {"status": "passed" if report["passed"] else "failed", "figures": figures}
    if failed:
        record["reason"] = "failed checks: " + ", ".join(failed)
    return record


def nsys(context: Context) -> dict:
    """model.nsys_profile on gpt3/126m: steps 5-7 of rank 0 captured by Nsight Systems; the
    report exists and nsys lists CUDA kernels in it. Rehearsal: the GPU recipe's dry run
    renders the profiled command."""
    import shutil

    gpu = on_gpu(context)
    prepare_data(context)
    log_dir = context.work / "nsys"
    profile = [
        "training.model.nsys_profile.enabled=true",
        "training.model.nsys_profile.start_step=5",
        "training.model.nsys_profile.end_step=7",
        "training.model.nsys_profile.ranks=[0]",
    ]
    overrides = [*training_overrides(context, log_dir, True), *profile]
    overrides = [o for o in overrides if not o.startswith("training.trainer.max_steps=")]
    overrides += ["training.trainer.max_steps=10"]
    command = [sys.executable, "main.py", "stages=[training]", "cluster_type=local", *overrides]
    if not gpu:
        result = context.run([*command, "dry_run=true"], timeout=120)
        script = (context.work / "results" / "gpt3_126m" / "gpt3_126m_submission.sh").read_text()
        rendered = result.returncode == 0 and "launcher_scripts.jobs.profiled" in script
        status = "passed" if rendered else "failed"
        return {"status": status, "figures": {"profiled_command_rendered": rendered}}
    tool = shutil.which("nsys")
    if tool is None:
        raise StepEnds("skipped", "nsys (Nsight Systems) is not on PATH on this machine")
    tick = time.monotonic()
    result = context.run(command, timeout=240)
    seconds = round(time.monotonic() - tick, 1)
    report = log_dir / "nsys_profile" / "profile_rank0.nsys-rep"
    figures: dict = {"run_s": seconds, "exit": result.returncode, "report": report.is_file()}
    if report.is_file():
        figures["report_mb"] = round(report.stat().st_size / 2**20, 2)
        stats = context.run([tool, "stats", "--report", "cuda_gpu_kern_sum", str(report)], 120)
        figures["kernels_listed"] = stats.returncode == 0 and "Time (%)" in stats.stdout
    ok = result.returncode == 0 and figures.get("kernels_listed", False)
    return {"status": "passed" if ok else "failed", "figures": figures}


# In this order: what later steps read first (training -> conversion -> the steps on its file),
# the quick and the most asked-for before the long ones, so a run cut short loses the least.
STEPS: dict[str, Step] = {
    "ceiling": Step(ceiling, budget_s=20, rehearsal_s=30),
    "probe": Step(probe, budget_s=40, rehearsal_s=30),
    "training": Step(training, budget_s=130, rehearsal_s=150),
    "conversion": Step(conversion, budget_s=30, rehearsal_s=60),
    "generation": Step(generation, budget_s=30, rehearsal_s=60),
    "evaluation": Step(evaluation, budget_s=40, rehearsal_s=90),
    "finetuning": Step(finetuning, budget_s=70, rehearsal_s=150),
    "memory": Step(memory, budget_s=100, rehearsal_s=150),
    "recompute": Step(recompute, budget_s=70, rehearsal_s=90),
    "encoders": Step(encoders, budget_s=60, rehearsal_s=120),
    "moe": Step(moe, budget_s=40, rehearsal_s=60),
    "vllm": Step(vllm_step, budget_s=60, rehearsal_s=90),
    "nsys": Step(nsys, budget_s=60, rehearsal_s=60),
}
