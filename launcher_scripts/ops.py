"""`status`, `logs` and `cancel` of a run, read from its manifest, so they work later too."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from launcher_scripts.clusters import BACKENDS, JobLog, JobRecord
from launcher_scripts.clusters.base import TERMINAL_STATES
from launcher_scripts.manifest import Manifest, corrupt_manifest, find_manifest


def load(target: str) -> Manifest:
    """The manifest, with each job's state refreshed from its backend."""
    manifest = Manifest.load(find_manifest(target))
    for record in manifest.jobs():
        if record.backend not in BACKENDS:
            problem = f"names an unknown backend {record.backend!r} for job {record.name!r}"
            raise corrupt_manifest(manifest.path, problem)
    for record in manifest.jobs():
        BACKENDS[record.backend]().refresh(record)
    return manifest


def default_results_dir() -> str:
    """base_results_dir as conf/config.yaml sets it when no override names it."""
    from launcher_scripts.config.resolvers import launcher_root, output_root

    return str(Path(output_root(launcher_root())) / "results")


def status(args: argparse.Namespace) -> int:
    manifest = load(args.run_dir or default_results_dir())
    if args.json:
        data = {
            "run_id": manifest.run_id,
            "manifest": str(manifest.path),
            "cluster_type": manifest.cluster_type,
            "stages": [stage.to_json() for stage in manifest.stages],
        }
        print(json.dumps(data, indent=2))
        return 0
    print(f"run {manifest.run_id} ({manifest.cluster_type}), manifest {manifest.path}")
    header = ("STAGE", "JOB", "STATE", "EXIT", "JOB IDS", "ATTEMPTS", "START", "END")
    rows = [header] + [
        (
            r.stage,
            r.name,
            r.state,
            "" if r.exit_code is None else str(r.exit_code),
            ",".join(r.job_ids),
            _attempts(r),
            r.start or "",
            r.end or "",
        )
        for r in manifest.jobs()
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    for record in manifest.jobs():
        for node, why in record.excluded_nodes.items():
            print(
                f"{record.name}: requeued without {node} after attempt {why.get('attempt')} "
                f"({why.get('srun')})"
            )
        if record.state in ("FAILED", "LOST"):
            print(f"{record.name} {record.state.lower()}: see {record.log}")
    return 0


def _attempts(record: JobRecord) -> str:
    """How many times a requeueable job has started (its attempt logs); blank for others."""
    attempts = [log.attempt for log in BACKENDS[record.backend]().logs(record)]
    numbered = [a for a in attempts if a is not None]
    return str(max(numbered) + 1) if numbered else ""


def _selected(manifest: Manifest, stage: str | None) -> list[JobRecord]:
    jobs = [r for r in manifest.jobs() if stage in (None, r.stage, r.name)]
    if not jobs:
        names = sorted({r.stage for r in manifest.jobs()} | {r.name for r in manifest.jobs()})
        raise SystemExit(
            f"error: no stage or job {stage!r} in this run; choose from {', '.join(names)}"
        )
    return jobs


def logs(args: argparse.Namespace) -> int:
    manifest = load(args.run_dir)
    for record in _selected(manifest, args.stage):
        backend = BACKENDS[record.backend]()
        offsets: dict[Path, int] = {}
        shown = _print_logs(record, backend.logs(record), args, offsets)
        if not shown and not args.follow:
            print(f"==> {record.name} ({record.state}): {_no_log_reason(record, args)}")
        while args.follow and record.state not in TERMINAL_STATES:
            time.sleep(1)
            record = next(r for r in load(args.run_dir).jobs() if r.name == record.name)
            _print_logs(record, backend.logs(record), args, offsets)
        if args.follow:
            _print_logs(record, backend.logs(record), args, offsets)
    return 0


def _print_logs(
    record: JobRecord, found: list[JobLog], args: argparse.Namespace, offsets: dict[Path, int]
) -> bool:
    """Print what is new in each wanted log file; a header before each file's first bytes."""
    wanted = [
        log
        for log in found
        if args.task in (None, log.task) and args.attempt in (None, log.attempt)
    ]
    for log in wanted:
        if log.path not in offsets:
            label = f", {log.label}" if log.label else ""
            print(f"==> {record.name} ({record.state}{label}): {log.path}", flush=True)
            offsets[log.path] = 0
        offsets[log.path] = _print_from(log.path, offsets[log.path])
    return bool(wanted)


def _print_from(log: Path, offset: int) -> int:
    with log.open("rb") as handle:
        handle.seek(offset)
        data = handle.read()
    sys.stdout.buffer.write(data)
    sys.stdout.flush()
    return offset + len(data)


def _no_log_reason(record: JobRecord, args: argparse.Namespace) -> str:
    if args.task is not None or args.attempt is not None:
        return "no log of that task or attempt"
    return f"no log yet at {record.log}: the job has not started"


PROGRESS_SECONDS = 15  # how often a cancel waiting for checkpoints says so
ENDED_STATES = TERMINAL_STATES - {"LOST"}


def cancel(args: argparse.Namespace) -> int:
    """Every job of the run that has not ended is stopped. A job that checkpoints on a signal
    (training) gets it and its grace period to save and exit, then is ended; others end now."""
    manifest = load(args.run_dir)
    manifest.cancel_marker.touch()
    # LOST: its launcher is gone, but what the job left may still run.
    active = [r for r in manifest.jobs() if r.state not in ENDED_STATES]
    waiting: list[tuple[JobRecord, float]] = []
    for record in active:
        ids = ",".join(record.job_ids) or "not started"
        print(f"cancel requested: {record.name} ({record.state}, {ids})", flush=True)
        backend = BACKENDS[record.backend]()
        if args.now:
            backend.end(record)
            continue
        grace = backend.cancel(record)
        if record.state == "LOST":
            print(f"  {record.name}: its program had ended; ended what it left running")
        elif grace is not None:
            if record.checkpoint_exit_code is not None:
                what = (
                    f"sent its checkpoint signal; it has up to {grace} s to save a checkpoint "
                    f"and exit (code {record.checkpoint_exit_code}) before it is ended"
                )
            else:
                what = f"asked to stop; it is ended if it has not within {grace} s"
            print(f"  {record.name}: {what}", flush=True)
            waiting.append((record, time.monotonic() + grace))
    if not active:
        print(f"run {manifest.run_id}: nothing to cancel, every job has ended")
    _wait_for_stops(waiting)
    return 0


def _wait_for_stops(waiting: list[tuple[JobRecord, float]]) -> None:
    """Wait for each signalled job to stop, ending it at its deadline; say where it stands."""
    said = time.monotonic()
    while waiting:
        for record, deadline in list(waiting):
            backend = BACKENDS[record.backend]()
            if backend.stopped(record):
                backend.end(record)  # processes it left behind
                print(f"{record.name}: stopped", flush=True)
            elif time.monotonic() >= deadline:
                backend.end(record)
                print(
                    f"{record.name}: did not stop within its grace period: ended it (its newest "
                    "complete checkpoint is the one before)",
                    flush=True,
                )
            else:
                continue
            waiting.remove((record, deadline))
        if waiting and time.monotonic() - said >= PROGRESS_SECONDS:
            said = time.monotonic()
            for record, deadline in waiting:
                left = max(0, round(deadline - said))
                print(f"  waiting for {record.name} to checkpoint ({left} s left)", flush=True)
        if waiting:
            time.sleep(0.5)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python3 -m launcher_scripts", description=__doc__)
    commands = top.add_subparsers(dest="command", required=True)
    show = commands.add_parser("status", help="state of every job of a run")
    show.add_argument(
        "run_dir",
        nargs="?",
        help="a stage results folder, base_results_dir, or a run folder (default: the newest "
        "run under the default base_results_dir)",
    )
    show.add_argument("--json", action="store_true", help="print the manifest's records as JSON")
    show.set_defaults(handler=status)
    read = commands.add_parser("logs", help="print the logs of a run, or of one stage or job")
    read.add_argument("run_dir")
    read.add_argument("stage", nargs="?", help="a stage or job name; all when left out")
    read.add_argument(
        "-f", "--follow", action="store_true", help="keep printing until the job ends"
    )
    read.add_argument("--task", type=int, help="only this array task's log (Slurm arrays)")
    read.add_argument(
        "--attempt", type=int, help="only this attempt's log (0 first, 1 after a requeue, ...)"
    )
    read.set_defaults(handler=logs)
    stop = commands.add_parser(
        "cancel",
        help="cancel the running and pending jobs of a run; a training job first saves a "
        "checkpoint (up to cluster.signal_grace_seconds)",
    )
    stop.add_argument("run_dir")
    stop.add_argument(
        "--now", action="store_true", help="end every job at once, without the checkpoint"
    )
    stop.set_defaults(handler=cancel)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from launcher_scripts.errors import LauncherError

    try:
        return args.handler(args)
    except LauncherError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    except BrokenPipeError:
        # `status | head`: the reader has gone. Nothing more to say, and nothing for Python's
        # final flush of stdout to fail on; a shell's code for a writer ended by SIGPIPE.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
