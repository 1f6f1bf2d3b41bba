"""Which node a failed multi-node step lost, for the training script's requeue without it.

When a task of a Slurm step fails, srun names its node first (`srun: error: node-b: task 2:
Killed`, or `srun: error: Node failure on node-b`) and only then the tasks it ended because of
it (`--kill-on-bad-exit`). Given the attempt's log, this prints the Slurm node list the
requeued job must exclude: the nodes excluded before (the script's own `--exclude` and the
failures of earlier attempts, kept in `--record`) and the new one. The record is JSON
(node -> what failed there, and in which attempt), which `launcher_scripts status` shows.

Exit 0 with the list on stdout; exit 1, printing why, when the log names no failed node (the
failure then is not one a requeue elsewhere would cure).

    python3 -m launcher_scripts.jobs.failed_node --log LOG --record FILE --attempt N \
        [--exclude LIST]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from launcher_scripts.files import write_atomic

# srun's own lines (slurm src/srun/.../launch_slurm.c): one task or a range on a node, or the
# node itself lost.
TASK_FAILED = re.compile(r"^srun: error: (?P<node>[^\s:]+): tasks? [0-9,\-]+: (?P<what>.+)$")
NODE_FAILED = re.compile(r"^srun: error: Node failure on (?P<node>\S+)")


def first_failed_node(log_text: str) -> tuple[str, str] | None:
    """(node, srun's line) of the first failure srun reported, or None."""
    for line in log_text.splitlines():
        line = line.strip()
        found = NODE_FAILED.match(line) or TASK_FAILED.match(line)
        if found:
            return found.group("node"), line
    return None


def read_record(path: Path) -> dict[str, dict]:
    try:
        record = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="failed_node", description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", type=Path, required=True, help="this attempt's log")
    parser.add_argument("--record", type=Path, required=True, help="the job's excluded nodes")
    parser.add_argument("--attempt", type=int, required=True, help="SLURM_RESTART_COUNT")
    parser.add_argument("--exclude", default="", help="the script's own --exclude list")
    args = parser.parse_args(argv)
    try:
        text = args.log.read_text(errors="replace")
    except OSError as error:
        print(f"launcher: cannot read {args.log}: {error.strerror}", file=sys.stderr)
        return 1
    failed = first_failed_node(text)
    if failed is None:
        print("launcher: srun named no failed node in this attempt's log", file=sys.stderr)
        return 1
    node, line = failed
    record = read_record(args.record)
    record.setdefault(node, {"attempt": args.attempt, "srun": line})
    write_atomic(args.record, json.dumps(record, indent=2) + "\n")
    print(",".join(part for part in (args.exclude, *record) if part))
    return 0


if __name__ == "__main__":
    sys.exit(main())
