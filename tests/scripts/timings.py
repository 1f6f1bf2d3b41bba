"""Where a test run's time went, from the JSON lines conftest writes with PYTEST_TIMINGS=FILE:
each worker's busy time and idle tail, the slowest modules and groups, the slowest tests.

    PYTEST_TIMINGS=/tmp/t.jsonl python3 -m pytest -q tests
    python3 -m tests.scripts.timings /tmp/t.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def main(path: str, top: int = 25) -> None:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    start = min(row["end"] - row["seconds"] for row in rows)
    end = max(row["end"] for row in rows)
    busy: dict[str, float] = defaultdict(float)
    last: dict[str, float] = defaultdict(float)
    per_unit: dict[str, float] = defaultdict(float)
    per_test: dict[str, float] = defaultdict(float)
    cpu_per_unit: dict[str, float] = defaultdict(float)
    cpu_per_test: dict[str, float] = defaultdict(float)
    for row in rows:
        busy[row["worker"]] += row["seconds"]
        last[row["worker"]] = max(last[row["worker"]], row["end"])
        test, _, group = row["test"].partition("@")
        unit = group or test.split("::")[0]
        per_unit[unit] += row["seconds"]
        per_test[row["test"]] += row["seconds"]
        cpu_per_unit[unit] += row.get("cpu", 0.0)
        cpu_per_test[row["test"]] += row.get("cpu", 0.0)
    print(f"run: {end - start:.0f} s from the first test to the last")
    for worker in sorted(busy):
        print(f"  {worker}: busy {busy[worker]:.0f} s, idle after {last[worker] - start:.0f} s")
    ranking(f"slowest modules and groups (of {sum(per_unit.values()):.0f} s):", per_unit, top)
    ranking("slowest tests (setup, call and teardown together):", per_test, top)
    if any(cpu_per_unit.values()):
        # On a machine the workers share, what a test costs is its CPU seconds: its durations
        # also count the time it waited for the other worker's processes.
        total = sum(cpu_per_unit.values())
        ranking(f"modules and groups by CPU seconds (of {total:.0f}):", cpu_per_unit, top)
        ranking(
            "tests by CPU seconds (the worker's and the processes it waited for):",
            cpu_per_test,
            top,
        )


def ranking(title: str, seconds_of: dict[str, float], top: int) -> None:
    """The `top` largest entries, largest first."""
    print(f"\n{title}")
    for name, seconds in sorted(seconds_of.items(), key=lambda item: -item[1])[:top]:
        print(f"  {seconds:7.1f} s  {name}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
