"""A real Triton server started by `launcher_scripts serve`, and what its clients get."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from launcher_scripts.jobs.export.install import bundled_server, default_venv, venv_python
from tests.support import REPO, missing
from tests.support.commands import ONE_THREAD, run_module

# Loading the models takes seconds on an idle machine and minutes on a busy CI runner.
READY_TIMEOUT = 1200


def serve_command(export_dir: Path, *options: str) -> list[str]:
    """`python3 -m launcher_scripts serve EXPORT_DIR`, as a user starts it."""
    command = [sys.executable, "-m", "launcher_scripts", "serve", str(export_dir)]
    return [*command, f"--ready-timeout={READY_TIMEOUT}", *options]


def shown(log: Path) -> str:
    """A serve log for a failed test: its `error:` lines (the cause, often above the ranks'
    tracebacks on the SIGTERM that followed it), then its end."""
    text = log.read_text()
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    return "\n".join([*errors, "...", text[-3000:]])


def started_serve(export_dir: Path, log: Path, *options: str, **popen: Any) -> subprocess.Popen:
    """`serve EXPORT_DIR options...`, its output in `log`, once it says it is ready (killed, its
    log shown, if it stops or does not get there)."""
    with log.open("w") as output:
        process = subprocess.Popen(
            serve_command(export_dir, *options),
            stdout=output,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=ONE_THREAD,
            **popen,
        )
    try:
        deadline = time.monotonic() + READY_TIMEOUT + 60
        while "ready: models" not in log.read_text():
            assert process.poll() is None, shown(log)
            assert time.monotonic() < deadline, shown(log)
            time.sleep(0.5)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process


def logged(log: Path, pattern: str, process: subprocess.Popen, timeout: float = 600) -> None:
    """Until `pattern` (a regular expression) is in `log`; fails if `process` stops first (the
    timeout only bounds a test that would otherwise hang)."""
    deadline = time.monotonic() + timeout
    while not re.search(pattern, log.read_text()):
        assert process.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.2)


def model_server_processes(serve_pid: int) -> list[psutil.Process]:
    """The model server's processes under `serve` (torchrun and its ranks, or the one process)."""
    found = [
        process
        for process in psutil.Process(serve_pid).children(recursive=True)
        if "launcher_scripts.jobs.inference.model_server" in process.cmdline()
    ]
    assert found, f"no model server under serve (pid {serve_pid})"
    return found


@contextlib.contextmanager
def triton_server(export_dir: Path) -> Iterator[tuple[int, int]]:
    """`python3 -m launcher_scripts serve EXPORT_DIR` running until the block ends, as a user
    starts it; yields its (HTTP, gRPC) ports. Its log is EXPORT_DIR/serve.log."""
    from launcher_scripts.ports import free_port

    http_port, grpc_port = free_port(), free_port()
    process = started_serve(
        export_dir,
        export_dir / "serve.log",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
    )
    try:
        yield http_port, grpc_port
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=300)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    processes = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert not any(
        "tritonserver" in line and str(export_dir) in line for line in processes.splitlines()
    ), "the server outlived serve"


def client_check(
    triton_python: Path, model: str, ports: tuple[int, int], prompts: list[str], tmp_path: Path
) -> dict[str, Any]:
    """tests/scripts/triton_client_check.py's answers from the served `model` (tritonclient
    runs in the Triton environment's python)."""
    prompts_file = tmp_path / "client_prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    result = run_module(
        "tests.scripts.triton_client_check",
        model,
        str(ports[0]),
        str(ports[1]),
        str(prompts_file),
        python=triton_python,
        env=None,
    )
    return json.loads(result.stdout.splitlines()[-1])


def in_process(
    model: Path, prompts: list[str], tmp_path: Path, tokens: int, *overrides: str
) -> list[str]:
    """Completions of `prompts` by generation in a process of its own (the served model's
    code, no server): what a server must answer."""
    prompts_file = tmp_path / "in_process_prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    result = run_module(
        "tests.scripts.generate_text",
        str(model),
        str(prompts_file),
        str(tokens),
        *overrides,
        timeout=300,
    )
    return json.loads(result.stdout.splitlines()[-1])


def serves_like_in_process(
    triton_python: Path,
    model: str,
    ports: tuple[int, int],
    model_file: Path,
    prompts: list[str],
    tmp_path: Path,
) -> tuple[dict[str, Any], list[str]]:
    """Asserts that the served `model` answers as in-process generation on `model_file` does:
    greedy text over HTTP (one request of all prompts, one request each), gRPC and streaming,
    beam search, a seeded sample twice, a stop word. Returns the client's answers (with the
    bad requests' errors) and the greedy texts."""
    served = client_check(triton_python, model, ports, prompts, tmp_path)
    greedy = in_process(model_file, prompts, tmp_path, 12)
    assert all(greedy)
    assert served["http_batch"] == greedy  # one request of all rows
    assert served["http_single"] == greedy  # a request each
    assert served["grpc"] == greedy
    assert "".join(served["stream_pieces"]) == greedy[0]
    assert len(served["stream_pieces"]) > 1  # it really streamed
    assert served["http_beam"] == in_process(model_file, prompts, tmp_path, 8, "beam_width=3")[:1]
    first, second = served["http_sampled"]
    assert first == second  # the same seed gives the same text
    text, reason = served["http_stop"][0].rsplit("|", 1)
    assert "." not in text
    assert reason == "stop" or (reason in ("length", "eod") and "." not in greedy[0])
    assert served["http_after_errors"] == greedy[:1]
    return served, greedy


def post(port: int, path: str, body: bytes | object) -> tuple[int, dict]:
    """An HTTP POST as any client sends it; (status, the JSON answer)."""
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, first_event(response.read())
    except urllib.error.HTTPError as error:
        return error.code, first_event(error.read())


def first_event(answer: bytes) -> dict:
    """The JSON answer; of a server-sent-event stream (generate_stream), its first event."""
    text = answer.decode()
    return json.loads(text.removeprefix("data: ").split("\n\n")[0])


def server_python() -> Path:
    """The python of the Triton environment `install-triton` made: skipped without, failed in
    CI."""
    venv = default_venv()
    if not (bundled_server(venv) / "bin" / "tritonserver").is_file():
        missing(f"no Triton server in {venv}: run `python3 -m launcher_scripts install-triton`")
    return venv_python(venv)
