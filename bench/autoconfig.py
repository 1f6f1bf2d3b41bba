"""How well the AutoConfigurator's predicted step times rank the layouts it measures.

    python3 bench/autoconfig.py [--steps 12] [--warmup 3] [--repeat 2] [--workdir DIR]
                                [override ...]

For the tiny GPT search config (gpt3/tiny: 4 layers, hidden 128, two processes on the CPU,
one thread each) it, in one run,
  1. calibrates the ClusterSpec for this machine, in this process and the same way each time:
       peak_tflops         the best fp32 matmul rate on one thread (the runs give each
                           process one thread), best of 5 timings, of two workloads: a
                           1024 x 1024 x 1024 matmul, and one transformer layer's four forward
                           projections (QKV, attention output, fc1, fc2) for one sequence of
                           the model (small enough to stay in cache, these are often faster);
       compute_efficiency, layer_overhead_us
                           from a real megatron-core GPT of the model's shape (local layer
                           spec, one process, one thread): forward and backward timed at
                           micro-batches 1, 2 and 4 and fitted to a line, time = fixed +
                           samples x per-sample. The per-sample slope against the model's
                           FLOPs per sample gives the efficiency, the fixed part over the layers
                           the per-layer overhead (operator dispatch: on a CPU and a tiny model
                           it is most of the time, and it does not shrink with TP);
       collective_latency_us  half a two-process gloo all-reduce of 4 bytes (a two-rank
                           ring all-reduce is two steps, each paying it), timed in context:
                           each process computes about a millisecond between all-reduces, as
                           in training, and the time beyond that compute is the all-reduce's.
                           Back to back, gloo answers in about a fifth of that; in training
                           the processes arrive apart and each must wake the other;
       intra_node_gbps     a gloo all-reduce of 1 MiB between two processes (between the
                           per-layer tensor-parallel activations, 0.1-0.3 MiB, and the
                           gradients, 7 MiB), in context as above: the message size over its
                           time less the two latencies, as the throughput model counts it;
       dp_overlap          0: on the CPU the training program does not overlap the gradient
                           reduction with the backward pass (trainer.py, overlap_grad_reduce);
  2. predicts every candidate of the search space with that spec, drops the invalid and the
     ones that do not fit (as the search does), and ranks the rest by predicted step time;
  3. measures EVERY feasible candidate with a short run (--steps steps, the first --warmup left
     out) through the search's own runner (auto_configurator/runner.py, the local backend),
     --repeat times, every other repeat in reverse order so drift in machine load does not
     follow the predicted rank; a candidate's measured step time is the median over repeats;
  4. prints the table, the Spearman rank correlation of predicted and measured step times over
     all measured candidates, and how many measured runs the search (taking candidates in
     predicted order) needs to reach the measured-best candidate, and to reach one within 5% of
     it (runs of a tiny model differ by a few percent from one repeat to the next).
Extra `key=value` arguments are overrides of the AutoConfigurator's config, e.g.
`search_config.train_settings.micro_batch_sizes=[1,2,4]` for a larger space.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from auto_configurator import base_config, runner  # noqa: E402
from auto_configurator.candidates import Evaluated, require_feasible  # noqa: E402
from auto_configurator.config import compose_config  # noqa: E402
from auto_configurator.main import train_settings  # noqa: E402
from auto_configurator.report import spearman  # noqa: E402
from auto_configurator.settings import parse  # noqa: E402
from launcher_scripts.costmodel.throughput import model_flops_per_sample  # noqa: E402
from launcher_scripts.ports import free_port  # noqa: E402
from launcher_scripts.recipes.model_shape import ModelShape  # noqa: E402

SEARCH_CONFIG = "gpt3/tiny"
NEAR_BEST = 0.05  # "within 5% of the measured best"
ALLREDUCE_BYTES = 2**20


# ----- calibration -----------------------------------------------------------------------------


def matmul_rate(m: int, k: int, n: int, repeats: int = 5) -> float:
    """FLOP/s of an fp32 (m x k) @ (k x n) on this process's threads, best of `repeats`."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    calls = max(1, int(2e9 / (2 * m * k * n)))  # about 2 GFLOP per timing
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms the allocator and the kernels up
        start = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - start) / calls)
    return 2 * m * k * n / best


def layer_rate(shape: ModelShape, repeats: int = 5) -> float:
    """FLOP/s of one layer's four forward projections for one sequence, best of `repeats`."""
    s, h = shape.seq_length, shape.hidden_size
    gemms = [
        (s, h, shape.query_size + 2 * shape.kv_size),  # QKV
        (s, shape.query_size, h),  # attention output
        (s, h, shape.fc1_size),  # fc1
        (s, shape.ffn_hidden_size, h),  # fc2
    ]
    operands = [(torch.randn(m, k), torch.randn(k, n)) for m, k, n in gemms]
    flops = sum(2 * m * k * n for m, k, n in gemms)
    calls = max(1, int(1e9 / flops))
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for _ in range(calls):
            for a, b in operands:
                torch.mm(a, b)
        best = min(best, (time.perf_counter() - start) / calls)
    return flops / best


ALLREDUCE_CALLS = 200


def _allreduce_worker(rank: int, port: int, out: str, nbytes: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tensor = torch.ones(max(1, nbytes // 4))
    a, b = torch.randn(512, 128), torch.randn(128, 512)

    def compute() -> None:  # about a millisecond, like a layer's work between two all-reduces
        for _ in range(3):
            torch.mm(a, b)

    def timed(with_all_reduce: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(ALLREDUCE_CALLS):
            compute()
            if with_all_reduce:
                dist.all_reduce(tensor)
        return time.perf_counter() - start

    timed(True)  # warm-up
    compute_only = min(timed(False) for _ in range(3))
    with_all_reduce = statistics.median(timed(True) for _ in range(3))
    if rank == 0:
        Path(out).write_text(str(max(with_all_reduce - compute_only, 0.0) / ALLREDUCE_CALLS))
    dist.destroy_process_group()


def spawned_result(worker: Callable[..., None], processes: int, *args: object) -> str:
    """Run worker(rank, port, out_file, *args) in `processes` fresh processes (a gloo group on
    a free port); returns what they wrote to out_file."""
    with tempfile.NamedTemporaryFile(suffix=".out") as out:
        mp.start_processes(
            worker,
            args=(free_port("127.0.0.1"), out.name, *args),
            nprocs=processes,
            start_method="spawn",
        )
        return Path(out.name).read_text()


def allreduce_seconds(nbytes: int) -> float:
    """Time a two-process gloo all-reduce of `nbytes` adds to each process's compute."""
    return float(spawned_result(_allreduce_worker, 2, nbytes))


def allreduce_link() -> tuple[float, float]:
    """(GB/s, latency in us) of this machine's two-process gloo all-reduce, in the alpha-beta
    terms of the throughput model: a two-rank ring all-reduce is 2 ring steps, each paying the
    latency, moving the message's bytes once. A 4-byte all-reduce gives the latency; a 1 MiB
    one, less that, the bandwidth."""
    latency = allreduce_seconds(4) / 2
    transfer = max(allreduce_seconds(ALLREDUCE_BYTES) - 2 * latency, 1e-9)
    return ALLREDUCE_BYTES / transfer / 1e9, latency * 1e6


PASS_BATCHES = (1, 2, 4)


def _model_pass_worker(rank: int, port: int, out: str, shape: ModelShape) -> None:
    """Median forward + backward time of the whole GPT at each of PASS_BATCHES."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from launcher_scripts.jobs.models.gpt import layer_spec
    from launcher_scripts.jobs.training import cpu_compat

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    cpu_compat.install()
    cpu_compat.seed_model_parallel_rngs(1234)
    cpu_compat.patch_cuda_queries()
    cpu_compat.CudaDevicesOnCpu().__enter__()  # as the training program does on a CPU
    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        calculate_per_token_loss=True,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, use_te=False, vp_stage=None),
        vocab_size=shape.padded_vocab(1),
        max_sequence_length=shape.seq_length,
    )
    medians = {}
    for batch in PASS_BATCHES:
        tokens = torch.randint(0, shape.vocab_size, (batch, shape.seq_length))
        positions = torch.arange(shape.seq_length).expand(batch, -1)
        times = []
        for _ in range(12):  # the first two warm up
            start = time.perf_counter()
            loss = model(tokens, positions, None, labels=tokens)
            loss.sum().backward()
            times.append(time.perf_counter() - start)
        medians[batch] = statistics.median(times[2:])
    Path(out).write_text(json.dumps(medians))
    dist.destroy_process_group()


def model_pass_line(shape: ModelShape) -> tuple[float, float]:
    """(fixed seconds, seconds per sample) of one forward + backward of the whole model: the
    least-squares line through its times at PASS_BATCHES."""
    written = json.loads(spawned_result(_model_pass_worker, 1, shape))
    medians = {int(batch): seconds for batch, seconds in written.items()}
    xs, ys = list(medians), list(medians.values())
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    return max(mean_y - slope * mean_x, 0.0), slope


def calibrate(shape: ModelShape) -> dict[str, float]:
    torch.set_num_threads(1)
    peak = max(matmul_rate(1024, 1024, 1024), layer_rate(shape))
    fixed, per_sample = model_pass_line(shape)
    achieved = model_flops_per_sample(shape, shape.padded_vocab(1)) / per_sample
    gbps, latency_us = allreduce_link()
    return {
        "peak_tflops": peak / 1e12,
        "compute_efficiency": min(achieved / peak, 1.0),
        "layer_overhead_us": fixed / shape.num_layers * 1e6,
        "intra_node_gbps": gbps,
        "collective_latency_us": latency_us,
        "dp_overlap": 0.0,
    }


# ----- the search's view and the measured runs -------------------------------------------------


def search_view(overrides: list[str]):  # type: ignore[no-untyped-def]
    """The composed config, settings, base config and the feasible candidates in the order the
    search takes them."""
    cfg = compose_config([f"search_config={SEARCH_CONFIG}", *overrides])
    settings = parse(cfg.search_config_value, train_settings(cfg))
    assert settings.model_size_in_b is not None
    base = base_config.generate(cfg, settings, settings.model_size_in_b)
    assert base.model is not None and base.space is not None
    ranking = require_feasible(base.evaluated, base.model, base.space, settings)
    return cfg, settings, base, ranking


def prepare_data(work: Path) -> Path:
    data = work / "data"
    if not (data / "custom_dataset" / "preprocessed").is_dir():
        subprocess.run(
            [
                sys.executable,
                str(REPO / "main.py"),
                "stages=[data_preparation]",
                f"data_dir={data}",
                f"base_results_dir={work}/prep",
            ],
            check=True,
            capture_output=True,
        )
    return data


def measure_all(cfg, settings, base, ranking: list[Evaluated], repeat: int) -> dict[int, list]:  # type: ignore[no-untyped-def]
    """Measured step times per predicted rank (1-based), one per repeat that measured it."""
    runs = runner.plan_runs(cfg, settings, base.path, base.recipe, [e.candidate for e in ranking])
    times: dict[int, list[float]] = {run.index: [] for run in runs}
    failures: dict[int, str] = {}
    for attempt in range(repeat):
        order = runs if attempt % 2 == 0 else runs[::-1]

        def progress(run: runner.Run, m: runner.Measurement, attempt: int = attempt) -> None:
            shown = f"{m.step_time_s * 1e3:.1f} ms/step" if m.measured else m.failure
            print(f"  repeat {attempt + 1}, {run.candidate.label}: {shown}", flush=True)

        for index, m in runner.run_local(order, cfg, settings, progress).items():
            if m.measured:
                times[index].append(m.step_time_s)
            else:
                failures[index] = m.failure or m.state
    for index, reason in failures.items():
        print(f"  predicted rank {index} failed at least once: {reason}")
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    parser.add_argument("--repeat", type=int, default=2, help="measurements per candidate")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="AutoConfigurator config overrides")
    args = parser.parse_args()
    if args.warmup >= args.steps:
        parser.error("--warmup must be below --steps")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-autoconfig-"))
    data = prepare_data(work)
    common = [
        f"base_results_dir={work}/search",
        f"data_dir={data}",
        "cluster_type=local",
        f"search_config.train_settings.max_steps_per_run={args.steps}",
        f"search_config.train_settings.warmup_steps_per_run={args.warmup}",
        *args.overrides,
    ]
    _, _, uncalibrated, _ = search_view(common)
    assert uncalibrated.model is not None
    spec = calibrate(uncalibrated.model.shape)
    print(f"cluster spec calibrated on this CPU ({os.cpu_count()} CPUs, one thread a process):")
    for key, value in spec.items():
        print(f"  {key:<20} {value:.4g}")
    cfg, settings, base, ranking = search_view(
        [*common, *(f"cluster_spec.{key}={value!r}" for key, value in spec.items())]
    )
    print(
        f"{len(base.evaluated)} candidates, {len(ranking)} feasible; measuring all of them, "
        f"{args.repeat} x {args.steps} steps each (steps {args.warmup + 1}..{args.steps} timed)",
        flush=True,
    )
    times = measure_all(cfg, settings, base, ranking, args.repeat)
    report(ranking, times, settings.limit_search_runs)
    return 0


def report(ranking: list[Evaluated], times: dict[int, list[float]], limit: int) -> None:
    measured = {i: statistics.median(ts) for i, ts in times.items() if ts}
    by_time = sorted(measured, key=measured.__getitem__)
    measured_rank = {index: rank for rank, index in enumerate(by_time, start=1)}
    print()
    header = f"{'pred':>4}  {'layout':<22}{'predicted ms':>13}{'measured ms':>13}{'meas':>6}"
    print(header)
    for index, e in enumerate(ranking, start=1):
        got = measured.get(index)
        print(
            f"{index:>4}  {e.candidate.label:<22}{e.prediction.step_time_s * 1e3:>13.1f}"
            + (f"{got * 1e3:>13.1f}{measured_rank[index]:>6}" if got else f"{'failed':>13}")
        )
    indices = sorted(measured)
    rho = spearman(
        [ranking[i - 1].prediction.step_time_s for i in indices], [measured[i] for i in indices]
    )
    best = by_time[0]
    near = min(i for i in indices if measured[i] <= measured[best] * (1 + NEAR_BEST))
    print(
        f"\nSpearman rank correlation, predicted vs measured step time over {len(indices)} "
        f"candidates: {rho:.2f}"
        if rho is not None
        else "\nSpearman: undefined"
    )
    print(
        f"measured runs the search needs (candidates in predicted order) to reach the "
        f"measured-best ({ranking[best - 1].candidate.label}, {measured[best] * 1e3:.1f} ms): "
        f"{best} of {len(ranking)}"
    )
    print(
        f"  to reach one within {NEAR_BEST:.0%} of it: {near} of {len(ranking)}; "
        f"gpt3/tiny's limit_search_runs={limit} "
        + ("finds the best" if best <= limit else "misses the best")
    )


if __name__ == "__main__":
    sys.exit(main())
