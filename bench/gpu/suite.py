"""The GPU suite's driver (bench/gpu/run.sh runs it): each step in its own child process,
time-boxed, recorded as passed, failed or skipped with its figures and the commands it ran; a
step that fails, raises or runs out of time does not stop the next.

    python3 bench/gpu/suite.py [--rehearse] [--out DIR]

Writes DIR/summary.json, DIR/summary.md and DIR/logs.tar.gz (one log per step). DIR: --out, else
$OUT, else a new folder under /tmp. --rehearse: every step on CPU with tiny sizes (same code paths
where the CPU allows; a step that needs CUDA reports "skipped: needs CUDA").
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
        f"- total: {summary['seconds']} s",
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rehearse", action="store_true", help="CPU, tiny sizes")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--step", choices=sorted(steps.STEPS), help=argparse.SUPPRESS)
    parser.add_argument("--scratch", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="*", default=None, help="these steps only")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (data, runs)")
    args = parser.parse_args()
    if args.step:
        return child_main(args.step, args.scratch, args.rehearse)
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    out = out or Path(tempfile.mkdtemp(prefix="gpu-suite-"))
    out.mkdir(parents=True, exist_ok=True)
    # Work files (data, checkpoints) and per-step logs stay out of OUT: only three files go back.
    scratch = Path(tempfile.mkdtemp(prefix="gpu-suite-work-"))
    for folder in ("steps", "logs", "work"):
        (scratch / folder).mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    records = []
    for name, step in steps.STEPS.items():
        if args.only is not None and name not in args.only:
            continue
        budget = step.rehearsal_s if args.rehearse else step.budget_s
        print(f"[suite] {name} (up to {budget} s) ...", flush=True)
        records.append(run_step(name, scratch, args.rehearse, budget))
        print(f"[suite] {name}: {records[-1]['status']} in {records[-1]['seconds']} s", flush=True)
    summary = {
        "rehearse": args.rehearse,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit(),
        "device": steps.device_name(),
        "host": platform.node(),
        "seconds": round(time.monotonic() - started, 1),
        "steps": records,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(markdown(summary))
    with tarfile.open(out / "logs.tar.gz", "w:gz") as archive:
        archive.add(scratch / "logs", arcname="logs")
        archive.add(scratch / "steps", arcname="steps")
    print(markdown(summary))
    if args.keep:
        print(f"[suite] work folder kept: {scratch}")
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"[suite] results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
