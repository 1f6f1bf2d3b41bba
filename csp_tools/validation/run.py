"""Validate a Slurm partition's nodes before spending it: diagnostics on every node, then an
all-reduce sweep over disjoint pairs of nodes whose failing pairs are re-paired with known-good
nodes, so that the report names the nodes to drain, not pairs.

    python3 -m csp_tools.validation --nodes=8 --nodelist=node-[0-7] --partition=gpu [--csp=aws]
        [--dcgm | --nccl] [--gpus-per-node=8] [--settings=site.yaml] [--results-dir=DIR]

(`bash csp_tools/<csp>/cluster_validation.sh ...` runs this with that provider's settings.)
Each step is an srun on the partition, run from this (login) node. Results go to
<results-dir>/<time>/: nodes.md/json, pairs.md/json, pairs.png (busbw of every measured pair),
verdict.json (the nodes to drain, which `cluster.exclude_unhealthy` reads). Exit 0 when every
node passed, 1 when some are to be drained, 2 when the command cannot run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from csp_tools.validation import report
from csp_tools.validation.bandwidth import Measurement, parse_nccl_tests, peak_busbw
from csp_tools.validation.node_probe import INJECT_ENV, Check
from csp_tools.validation.preflight import (
    UsageError,
    check_commands,
    check_partition,
    check_results_dir,
    check_time_limit,
    check_with_slurm,
    closest,
    srun_reason,
)
from csp_tools.validation.screening import (
    Limits,
    Pair,
    PairResult,
    disjoint_pairs,
    failures,
    known_good,
    retest_pairs,
    screen,
)
from csp_tools.validation.settings import CSP_ROOT, Settings, SettingsError, load, providers

CODE_ROOT = Path(__file__).resolve().parents[2]  # what the steps import csp_tools from


def default_results_dir() -> Path:
    from launcher_scripts.config.resolvers import launcher_root, output_root

    return Path(output_root(launcher_root())) / "results" / "cluster_validation"


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="cluster_validation", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--nodes", type=int, required=True, help="how many nodes the list has")
    parser.add_argument("--nodelist", required=True, help="as sinfo shows it: node-[0-7]")
    parser.add_argument("--partition", required=True)
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--dcgm", action="store_true", help="only the node diagnostics")
    only.add_argument("--nccl", action="store_true", help="only the interconnect sweep")
    parser.add_argument("--csp", default="generic", help=f"one of {', '.join(providers())}")
    parser.add_argument("--gpus-per-node", type=int, default=0, help="0: nodes without GPUs")
    parser.add_argument("--settings", type=Path, default=None, help="a site's validation.yaml")
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument("--time-limit", default="30", help="each step's srun --time (minutes)")
    parser.add_argument(
        "--inject-fault",
        action="append",
        default=[],
        metavar="NODE:CHECK",
        help="fail that node's check on purpose (to try the report and the exclusion)",
    )
    args = parser.parse_args(argv)
    if args.nodes < 1:
        raise UsageError(f"--nodes={args.nodes}: give the number of nodes the list has")
    check_time_limit(args.time_limit)
    for fault in args.inject_fault:
        if fault.count(":") != 1 or not all(fault.split(":")):
            raise UsageError(f"--inject-fault={fault}: give NODE:CHECK, e.g. node-3:memory_cpu")
    if args.gpus_per_node < 0:
        raise UsageError("--gpus-per-node must be 0 (no GPUs) or more")
    return args


def expand(nodelist: str, expected: int) -> list[str]:
    """`scontrol show hostnames`, checked against --nodes."""
    listed = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True
    )
    if listed.returncode != 0:
        raise UsageError(f"--nodelist={nodelist}: scontrol cannot read it: {listed.stderr.strip()}")
    nodes = listed.stdout.split()
    if len(nodes) != expected:
        raise UsageError(
            f"--nodes={expected} but --nodelist={nodelist} names {len(nodes)} nodes: "
            "make them agree"
        )
    return nodes


def check_faults(faults: Sequence[str], nodes: Sequence[str]) -> None:
    """An injected fault names a listed node: one for another node would be ignored."""
    for fault in faults:
        node = fault.split(":")[0]
        if node not in nodes:
            raise UsageError(
                f"--inject-fault={fault}: {node} is not in --nodelist{closest(node, nodes)}; "
                f"name one of {','.join(nodes)}"
            )


@dataclass
class Step:
    nodes: tuple[str, ...]
    command: list[str]
    tasks_per_node: int = 1
    env: dict[str, str] | None = None


class StepRefused(UsageError):
    """srun could not start a step (no allocation, so no task ran): the command's fault or
    Slurm's, never the nodes'."""


# srun --verbose prints this once Slurm has allocated the step's nodes; a step without it
# failed before any task could run on them.
_ALLOCATED = re.compile(r"^srun: jobid \d+: nodes\(", re.MULTILINE)


@dataclass(frozen=True)
class Finished:
    returncode: int
    stdout: str
    stderr: str  # without srun's --verbose lines

    @staticmethod
    def of(returncode: int, stdout: str, stderr: str, step: Step) -> Finished:
        if returncode != 0 and not _ALLOCATED.search(stderr):
            raise StepRefused(
                f"srun could not start a step on {','.join(step.nodes)}: "
                f"{srun_reason(stderr, returncode)}; no node was judged, fix the command"
            )
        return Finished(returncode, stdout, _without_srun_notes(stderr))


def _without_srun_notes(stderr: str) -> str:
    """The step's stderr less srun's informational lines (its errors stay)."""
    kept = [
        line
        for line in stderr.splitlines()
        if not line.startswith("srun: ") or line.startswith(("srun: error:", "srun: fatal:"))
    ]
    return "\n".join(kept)


def srun(step: Step, args: argparse.Namespace) -> list[str]:
    gpus = [f"--gpus-per-node={args.gpus_per_node}"] if args.gpus_per_node else []
    return [
        *("srun", "--verbose", f"--partition={args.partition}"),
        f"--nodelist={','.join(step.nodes)}",
        *(f"--nodes={len(step.nodes)}", f"--ntasks-per-node={step.tasks_per_node}", *gpus),
        *(f"--time={args.time_limit}", "--job-name=cluster-validation", f"--chdir={CODE_ROOT}"),
        "--export=ALL",
        *step.command,
    ]


def step_env(settings: Settings) -> dict[str, str]:
    return {**os.environ, **settings.env, "PYTHONPATH": str(CODE_ROOT)}


def run_all(steps: Sequence[Step], args: argparse.Namespace, settings: Settings) -> list[Finished]:
    """Every step at once, each as it finished, in order. StepRefused when srun could not
    start one (after all have ended)."""
    base = step_env(settings)
    running = [
        subprocess.Popen(
            srun(step, args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**base, **(step.env or {})},
        )
        for step in steps
    ]
    ended = [(process, *process.communicate()) for process in running]
    return [
        Finished.of(process.returncode, out, err, step)
        for step, (process, out, err) in zip(steps, ended, strict=True)
    ]


def json_lines(stdout: str) -> list[dict]:
    """The JSON records a step printed (its other output left out)."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def why_not(returncode: int, stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return lines[-1] if lines else f"exit {returncode}"


def diagnose(nodes: list[str], args: argparse.Namespace, settings: Settings) -> dict[str, dict]:
    """Each node's probe report; a probe that gave none is a failed check of its own."""
    faults: dict[str, list[str]] = {}
    for fault in args.inject_fault:
        node, check = fault.split(":")
        faults.setdefault(node, []).append(check)
    probe = [sys.executable, "-m", "csp_tools.validation.node_probe"]
    probe += [f"--matmul-fraction={settings.matmul_fraction}"]
    probe += [f"--memory-fraction={settings.memory_fraction}"]
    if args.gpus_per_node:
        probe += [f"--expect-gpus={args.gpus_per_node}", f"--dcgm-level={settings.dcgm_level}"]
    steps = [
        Step((node,), probe, env={INJECT_ENV: ",".join(faults.get(node, []))}) for node in nodes
    ]
    reports = {}
    for node, ran in zip(nodes, run_all(steps, args, settings), strict=True):
        found = json_lines(ran.stdout)
        if not found:
            detail = f"the probe gave no report: {why_not(ran.returncode, ran.stderr)}"
            failed = asdict(Check("probe", "fail", detail))
            found = [{"node": node, "passed": False, "checks": [failed]}]
        reports[node] = found[-1]
    return reports


def node_stragglers(reports: dict[str, dict], fraction: float) -> dict[str, list[str]]:
    """Nodes with a measured figure under `fraction` of the median node's, per check."""
    values: dict[str, dict[str, float]] = {}
    for node, found in reports.items():
        for check in found["checks"]:
            if check.get("value") is not None and check.get("unit"):
                values.setdefault(check["name"], {})[node] = float(check["value"])
    slow: dict[str, list[str]] = {}
    for name, by_node in values.items():
        if len(by_node) < 2:
            continue
        median = statistics.median(by_node.values())
        for node, value in by_node.items():
            if value < fraction * median:
                slow.setdefault(node, []).append(
                    f"{name}: {value:.3g} < {fraction:g} x median {median:.3g}"
                )
    return slow


def waves(pairs: Sequence[Pair]) -> list[list[Pair]]:
    """The pairs in rounds where no node is in two pairs at once."""
    rounds: list[list[Pair]] = []
    for pair in pairs:
        for wave in rounds:
            if not {n for p in wave for n in p} & set(pair):
                wave.append(pair)
                break
        else:
            rounds.append([pair])
    return rounds


def sweep_command(args: argparse.Namespace, settings: Settings) -> tuple[list[str], str]:
    """nccl-tests' all_reduce_perf on GPU nodes where it is on PATH or build-nccl-tests.sh built
    it, else the built-in sweep."""
    built = CSP_ROOT / "nccl-tests" / "build" / "all_reduce_perf"
    found = shutil.which("all_reduce_perf") or (str(built) if os.access(built, os.X_OK) else None)
    if args.gpus_per_node and found:
        sizes = [f"-b{settings.min_bytes}", f"-e{settings.max_bytes}", "-f4", "-g1"]
        return [found, *sizes], "nccl-tests"
    builtin = [sys.executable, "-m", "csp_tools.validation.allreduce_sweep"]
    builtin += [f"--min-bytes={settings.min_bytes}", f"--max-bytes={settings.max_bytes}"]
    return builtin, "built-in"


def sweep_tasks(args: argparse.Namespace) -> int:
    """Tasks per node of a sweep: one per GPU, or one on nodes without GPUs."""
    return max(1, args.gpus_per_node)


def measure(pairs: Sequence[Pair], args: argparse.Namespace, settings: Settings) -> list:
    command, _ = sweep_command(args, settings)
    results = []
    for wave in waves(pairs):
        steps = [Step(pair, command, tasks_per_node=sweep_tasks(args)) for pair in wave]
        for pair, ran in zip(wave, run_all(steps, args, settings), strict=True):
            results.append(pair_result(pair, ran.returncode, ran.stdout, ran.stderr))
    return results


def check_steps(nodes: list[str], args: argparse.Namespace, settings: Settings) -> None:
    """Before any step: the partition, its nodes and their GPUs, then a probe's and a pair's
    srun as Slurm takes them (nothing runs)."""
    check_partition(args.partition, nodes, args.gpus_per_node)
    shapes = [] if args.nccl else [Step((nodes[0],), ["true"])]
    shapes += [] if args.dcgm else [Step((nodes[0], nodes[1]), ["true"], sweep_tasks(args))]
    for shape in shapes:
        check_with_slurm(srun(shape, args), step_env(settings))


def pair_result(pair: Pair, code: int, out: str, err: str) -> PairResult:
    if code != 0:
        return PairResult(pair, None, why_not(code, err))
    rows = parse_nccl_tests(out)
    if rows:
        return PairResult(pair, max(rows.values()))
    records = json_lines(out)
    if not records:
        return PairResult(pair, None, "the sweep printed no result")
    measured = [Measurement(r["size_bytes"], r["seconds"], r["ranks"]) for r in records]
    return PairResult(pair, peak_busbw(measured))


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        settings = load(args.csp, args.settings)
        results_dir = args.results_dir or default_results_dir()
        check_results_dir(results_dir)
        check_commands()
        nodes = expand(args.nodelist, args.nodes)
        check_faults(args.inject_fault, nodes)
        if len(nodes) < 2 and not args.dcgm:
            raise UsageError("the interconnect sweep needs 2 nodes or more: list more, or --dcgm")
        check_steps(nodes, args, settings)
        return validate(args, settings, nodes, results_dir)
    except (UsageError, SettingsError) as error:
        print(f"cluster_validation: {error}", file=sys.stderr)
        return 2


def validate(
    args: argparse.Namespace, settings: Settings, nodes: list[str], results_dir: Path
) -> int:
    """The steps, then the report; StepRefused (before anything is written) when srun could
    not start one."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")  # sorts as time does: newest last
    folder = results_dir / stamp
    print(f"cluster_validation: {len(nodes)} nodes of {args.partition} ({args.csp}); {folder}")
    node_reports: dict[str, dict] = {}
    node_failures: dict[str, list[str]] = {}
    if not args.nccl:
        print("diagnostics: one probe per node ...", flush=True)
        node_reports = diagnose(nodes, args, settings)
        for node, found in node_reports.items():
            failed = [
                f"{c['name']}: {c['detail']}" for c in found["checks"] if c["status"] == "fail"
            ]
            if failed:
                node_failures[node] = failed
        for node, slow in node_stragglers(node_reports, settings.node_straggler_fraction).items():
            node_failures.setdefault(node, []).extend(f"straggler {s}" for s in slow)
    first: list[PairResult] = []
    retests: list[PairResult] = []
    limits = Limits(settings.min_busbw_gbps, settings.pair_straggler_fraction)
    if not args.dcgm:
        _, kind = sweep_command(args, settings)
        print(f"interconnect: {kind} all-reduce sweep over disjoint pairs ...", flush=True)
        first = measure(disjoint_pairs(nodes), args, settings)
        again = retest_pairs(list(failures(first, limits)), known_good(nodes, first, limits))
        if again:
            print(f"interconnect: {len(again)} suspects, each with a known-good node ...")
            retests = measure(again, args, settings)
    verdict = screen(nodes, first, retests, limits) if first else None
    drain = {node: "; ".join(why) for node, why in node_failures.items()}
    if verdict is not None:
        for node, why in verdict.bad.items():
            drain[node] = "; ".join(filter(None, [drain.get(node), f"interconnect: {why}"]))
    unconfirmed = dict(verdict.unconfirmed) if verdict is not None else {}
    report.write(
        folder,
        args=vars(args),
        nodes=nodes,
        node_reports=node_reports,
        pairs=first + retests,
        drain=drain,
        unconfirmed=unconfirmed,
    )
    report.print_summary(nodes, drain, unconfirmed, folder)
    return 1 if drain or unconfirmed else 0
