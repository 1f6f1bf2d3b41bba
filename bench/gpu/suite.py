"""The GPU suite's driver (bench/gpu/run.sh runs it): each step in its own child process,
time-boxed, recorded as passed, failed or skipped with its figures and the commands it ran; a
step that fails, raises or runs out of time does not stop the next.

    python3 bench/gpu/suite.py [--rehearse] [--out DIR] [--deadline SECONDS]

Writes DIR/summary.json, DIR/summary.md and DIR/logs.tar.gz (one log per step), after every step,
so a run cut off from outside still returns what it measured. DIR: --out, else $OUT, else a new
folder under /tmp. --rehearse: every step on CPU with tiny sizes (same code paths where the CPU
allows; a step that needs CUDA reports "skipped: needs CUDA"). --deadline: the whole suite's
seconds (default: GPU_DEADLINE_S on the GPU, none in the rehearsal); a step gets at most what is
left, and one that would start with less than MIN_STEP_S left is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.gpu import steps  # noqa: E402

STATUSES = ("passed", "failed", "skipped")
GPU_DEADLINE_S = 480.0  # the GPU machine runs one command for at most 10 minutes; install first
MIN_STEP_S = 10.0


def run_step(name: str, scratch: Path, rehearse: bool, budget: float) -> dict:
    """Run one step in a child process (its own session, killed whole on time-out)."""
    result_file = scratch / "steps" / f"{name}.json"
    log_file = scratch / "logs" / f"{name}.log"
    command = [sys.executable, str(Path(__file__)), "--step", name, "--scratch", str(scratch)]
    command += ["--rehearse"] if rehearse else []
    started = time.monotonic()
    with log_file.open("w") as log:
        child = subprocess.Popen(
            command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            child.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    seconds = round(time.monotonic() - started, 1)
    if result_file.exists():
        record = json.loads(result_file.read_text())
    else:
        tail = log_file.read_text()[-400:] if log_file.exists() else ""
        why = f"timed out after {budget:.0f} s" if child.returncode in (-9, None) else "crashed"
        record = {"status": "failed", "reason": f"{why} (exit {child.returncode}): {tail}"}
    record.setdefault("figures", {})
    record.setdefault("commands", [])
    record.update(name=name, seconds=seconds, budget_s=budget)
    return record


def child_main(name: str, scratch: Path, rehearse: bool) -> int:
    """Inside the child: run the step, write its record (an exception is a failure)."""
    context = steps.Context(scratch=scratch, work=scratch / "work", rehearse=rehearse)
    context.work.mkdir(parents=True, exist_ok=True)
    try:
        record = steps.STEPS[name].run(context)
    except steps.StepEnds as ended:
        record = dict(ended.record)
    except Exception as error:  # noqa: BLE001  (any error fails this step only)
        import traceback

        traceback.print_exc()
        record = {"status": "failed", "reason": f"{type(error).__name__}: {error}"}
    record.setdefault("commands", context.commands)
    record.setdefault("figures", {})
    assert record["status"] in STATUSES, record
    (scratch / "steps" / f"{name}.json").write_text(json.dumps(record, indent=1))
    return 0


def markdown(summary: dict) -> str:
    lines = [
        f"# GPU suite ({'rehearsal on CPU' if summary['rehearse'] else 'GPU run'})",
        "",
        f"- date: {summary['date']}; commit: {summary['commit']}; device: {summary['device']}",
        f"- total: {summary['seconds']} s"
        + ("" if summary.get("complete", True) else " (cut off: the steps below ran)"),
        "",
        "| step | status | seconds | figures / reason |",
        "|---|---|---|---|",
    ]
    for step in summary["steps"]:
        figures = ", ".join(f"{k}={v}" for k, v in step["figures"].items())
        detail = figures or step.get("reason", "")
        if step.get("reason") and figures:
            detail += f" ({step['reason']})"
        lines.append(f"| {step['name']} | {step['status']} | {step['seconds']} | {detail} |")
    lines += ["", "## Commands", ""]
    for step in summary["steps"]:
        for command in step["commands"]:
            lines.append(f"- {step['name']}: `{command}`")
    return "\n".join(lines) + "\n"


def commit() -> str:
    result = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    )
    return result.stdout.strip() or "unknown"


def write_results(out: Path, summary: dict, scratch: Path) -> None:
    """summary.json, summary.md and logs.tar.gz in OUT, each replaced whole."""
    for name, text in (
        ("summary.json", json.dumps(summary, indent=1)),
        ("summary.md", markdown(summary)),
    ):
        partial = out / f".{name}.partial"
        partial.write_text(text)
        partial.replace(out / name)
    partial = out / ".logs.tar.gz.partial"
    with tarfile.open(partial, "w:gz") as archive:
        archive.add(scratch / "logs", arcname="logs")
        archive.add(scratch / "steps", arcname="steps")
    partial.replace(out / "logs.tar.gz")


def step_budget(step: steps.Step, rehearse: bool, left: float | None) -> float | None:
    """The step's time box, cut to what the suite has left; None: too little left to start."""
    budget = step.rehearsal_s if rehearse else step.budget_s
    if left is None:
        return budget
    return min(budget, left) if left >= MIN_STEP_S else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rehearse", action="store_true", help="CPU, tiny sizes")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--step", choices=sorted(steps.STEPS), help=argparse.SUPPRESS)
    parser.add_argument("--scratch", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="*", default=None, help="these steps only")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (data, runs)")
    parser.add_argument(
        "--deadline", type=float, default=None, help="the whole suite's seconds (0: none)"
    )
    args = parser.parse_args()
    if args.step:
        return child_main(args.step, args.scratch, args.rehearse)
    unknown = sorted(set(args.only or ()) - set(steps.STEPS))
    if unknown:
        parser.error(f"--only: no step {', '.join(unknown)} (steps: {', '.join(steps.STEPS)})")
    deadline = (
        args.deadline if args.deadline is not None else (None if args.rehearse else GPU_DEADLINE_S)
    )
    deadline = deadline or None  # 0: none
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    out = out or Path(tempfile.mkdtemp(prefix="gpu-suite-"))
    out.mkdir(parents=True, exist_ok=True)
    # Work files (data, checkpoints) and per-step logs stay out of OUT: only three files go back.
    scratch = Path(tempfile.mkdtemp(prefix="gpu-suite-work-"))
    for folder in ("steps", "logs", "work"):
        (scratch / folder).mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    summary = {
        "rehearse": args.rehearse,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit(),
        "device": steps.device_name(),
        "host": platform.node(),
        "deadline_s": deadline,
        "complete": False,
        "seconds": 0.0,
        "steps": [],
    }
    records = summary["steps"]
    for name, step in steps.STEPS.items():
        if args.only is not None and name not in args.only:
            continue
        left = None if deadline is None else deadline - (time.monotonic() - started)
        budget = step_budget(step, args.rehearse, left)
        if budget is None:
            records.append(
                {
                    "name": name,
                    "status": "skipped",
                    "figures": {},
                    "commands": [],
                    "reason": f"no time left in the suite's {deadline:.0f} s",
                    "seconds": 0.0,
                    "budget_s": 0.0,
                }
            )
        else:
            print(f"[suite] {name} (up to {budget:.0f} s) ...", flush=True)
            records.append(run_step(name, scratch, args.rehearse, budget))
        print(f"[suite] {name}: {records[-1]['status']} in {records[-1]['seconds']} s", flush=True)
        summary["seconds"] = round(time.monotonic() - started, 1)
        write_results(out, summary, scratch)
    summary["complete"] = True
    summary["seconds"] = round(time.monotonic() - started, 1)
    write_results(out, summary, scratch)
    print(markdown(summary))
    if args.keep:
        print(f"[suite] work folder kept: {scratch}")
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"[suite] results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
