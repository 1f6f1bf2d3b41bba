"""What each test phase cost, recorded with PYTEST_TIMINGS=FILE: `python3 -m
tests.scripts.timings FILE` shows where a run's time went (per worker, per module and group,
and the idle tail)."""

from __future__ import annotations

import json
import os
import resource
import time

import pytest


def cpu_seconds() -> float:
    """CPU time of this process and of the child processes it has waited for (their own
    waited-for children included): what a test phase cost the machine, beyond its wall time."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


_cpu_at_last_report: list[float] = []


def start() -> None:
    _cpu_at_last_report[:] = [cpu_seconds()]


def record(report: pytest.TestReport) -> None:
    """Append the phase's worker, end time, duration and CPU seconds (the worker's and its
    finished child processes', since the worker's previous report) to PYTEST_TIMINGS's file,
    when it is set. On a busy machine the CPU seconds, not the durations, say which tests
    cost most."""
    path = os.environ.get("PYTEST_TIMINGS")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    if path and (worker != "main" or not hasattr(report, "node")):
        now = cpu_seconds()
        before = _cpu_at_last_report[-1] if _cpu_at_last_report else now
        _cpu_at_last_report[:] = [now]
        line = {
            "test": report.nodeid,
            "when": report.when,
            "worker": worker,
            "end": time.time(),
            "seconds": report.duration,
            "cpu": now - before,
        }
        with open(path, "a") as timings:
            timings.write(json.dumps(line) + "\n")
