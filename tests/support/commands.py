"""Running the launcher and the checkout's programs as a user does, and reading their one-line
refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support import REPO

# The environment a test gives a program it starts: this process's, with one OpenMP thread per
# process (why: tests/conftest.py, which sets it for the whole session; here for a helper used
# outside a test session too).
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_main(
    *overrides: str,
    cwd: Path | None = None,
    timeout: float = 600,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """`python3 main.py overrides...` as a user runs it, capturing its output. Its jobs run
    one thread per process (see ONE_THREAD); `extra_env` is added to the environment."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["OMP_NUM_THREADS"] = "1"
    env |= extra_env or {}
    return subprocess.run(
        [sys.executable, str(REPO / "main.py"), *overrides],
        capture_output=True,
        text=True,
        cwd=cwd or REPO,
        env=env,
        timeout=timeout,
    )


def ctrl_c_as_in_a_terminal() -> None:
    """`preexec_fn` for a program a test stops with SIGINT: SIGINT in its default state, as a
    program started from a terminal has it.

    A shell without job control (a CI script, `cmd &` in any script) starts background
    commands with SIGINT ignored, and an ignored signal stays ignored through exec: a test
    suite started so passes that on, the launcher's Python installs no KeyboardInterrupt
    handler, and the test's ctrl-c does nothing (the autoconfigurator's search returned 0;
    a local training ran on until the test's wait ran out)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_ops(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python3 -m launcher_scripts COMMAND ...` (status, logs, cancel, client, ...)."""
    return subprocess.run(
        [sys.executable, "-m", "launcher_scripts", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )


def run_module(
    module: str,
    *args: str,
    python: Path | str = sys.executable,
    env: dict[str, str] | None = ONE_THREAD,
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """`python -m module args...` from the checkout, which must succeed (its stderr shown
    when not). `env` None: this process's environment."""
    result = subprocess.run(
        [str(python), "-m", module, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def module_report(module: str, *args: str, processes: int = 1, timeout: float = 300) -> Any:
    """The JSON object a check script (tests/scripts/) prints last: `python -m module args`,
    under torchrun with `processes` > 1, one thread per process."""
    launcher = [sys.executable]
    if processes > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    result = subprocess.run(
        [*launcher, "-m", module, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ONE_THREAD,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def one_error_line(result: subprocess.CompletedProcess, *fragments: str) -> None:
    """A run that failed with exactly one `error:` line on stderr, holding every fragment."""
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and all(f in lines[0] for f in fragments), result.stderr[-2000:]


def assert_one_line_error(result, *fragments: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
