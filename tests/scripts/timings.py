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
    for row in rows:
        busy[row["worker"]] += row["seconds"]
        last[row["worker"]] = max(last[row["worker"]], row["end"])
        test, _, group = row["test"].partition("@")
        per_unit[group or test.split("::")[0]] += row["seconds"]
        per_test[row["test"]] += row["seconds"]
    print(f"run: {end - start:.0f} s from the first test to the last")
    for worker in sorted(busy):
        print(f"  {worker}: busy {busy[worker]:.0f} s, idle after {last[worker] - start:.0f} s")
    print(f"\nslowest modules and groups (of {sum(per_unit.values()):.0f} s):")
    for unit, seconds in sorted(per_unit.items(), key=lambda item: -item[1])[:top]:
        print(f"  {seconds:7.1f} s  {unit}")
    print("\nslowest tests (setup, call and teardown together):")
    for test, seconds in sorted(per_test.items(), key=lambda item: -item[1])[:top]:
        print(f"  {seconds:7.1f} s  {test}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
