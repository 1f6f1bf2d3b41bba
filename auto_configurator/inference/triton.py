"""TP = PP = 1 measured through the serving path a user deploys: the launcher's export stage
(`main.py stages=[export]`) writes the Triton model repository, `python3 -m launcher_scripts
serve` starts a real Triton server on it, and each measurement is one HTTP request holding
`batch` prompts. The served Triton model builds its runner at TP = PP = 1 only, so larger
layouts are measured with the runner alone (runs.py).

The export's `max_batch_size` is the largest batch size (Triton refuses larger requests) and
its queue delay 0 (a request waits for no other: one request is in flight at a time). A latency
is the client's wall time for the request: HTTP, Triton's queue and the Python backend included.
Generated tokens: output_len for a row that finished by length, else counted from its text.
"""

from __future__ import annotations

import json
import re
import signal
import statistics
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from auto_configurator.inference.prompts import continuation_tokens
from auto_configurator.inference.runs import (
    SEED,
    Point,
    last_error_line,
    run_logged,
    start,
    stop,
)
from auto_configurator.inference.settings import PREFIX, InferenceSettings
from launcher_scripts.errors import ConfigError
from launcher_scripts.jobs.inference.text_tokenizer import TextTokenizer

TRITON = "triton"
NOT_A_MODEL_NAME = re.compile(r"[^A-Za-z0-9_-]")


def available(settings: InferenceSettings) -> bool:
    """Whether TP = PP = 1 goes through Triton: serve_with_triton, or (auto) whether a Triton
    server is installed where `serve` looks."""
    if settings.serve_with_triton is False:
        return False
    from launcher_scripts.jobs.export.serve import ServeError, find_server

    try:
        find_server(None)
    except ServeError:
        if settings.serve_with_triton:
            raise ConfigError(
                f"{PREFIX}.run.serve_with_triton",
                "is true but no Triton server is installed",
                "Run `python3 -m launcher_scripts install-triton` or put tritonserver on PATH, "
                "or set serve_with_triton=auto",
            ) from None
        return False
    return True


@dataclass(frozen=True)
class Session:
    """What a Triton measurement needs from the search."""

    settings: InferenceSettings
    prompts: Sequence[str]
    tokenizer: TextTokenizer
    launcher_main: Path
    root: Path  # the launcher checkout: the working directory of the launcher's commands
    env: dict[str, str]

    @property
    def folder(self) -> Path:
        return self.settings.folder / "runs" / f"{TRITON}_tp1_pp1"

    @property
    def model_name(self) -> str:
        return NOT_A_MODEL_NAME.sub("_", self.settings.model_train_name)


def measure(session: Session) -> list[Point]:
    """Every batch size through one export and one server."""
    settings = session.settings
    export_log = session.folder / "export.log"
    code = run_logged(
        export_argv(session), export_log, session.root, session.env, settings.time_limit_s
    )
    if code is None:
        limit = settings.time_limit_s
        return _all_failed(session, f"timeout: the export passed run.time_limit ({limit} s)")
    if code != 0:
        return _all_failed(
            session, f"failed: export (exit code {code}): {last_error_line(export_log)}"
        )
    return _serve_and_measure(session)


def export_argv(session: Session) -> list[str]:
    s = session.settings
    deployment, generation = "export.triton_deployment", "export.generation"
    return [
        sys.executable,
        str(session.launcher_main),
        "stages=[export]",
        "cluster_type=local",
        f"base_results_dir={session.folder}",
        f"export.run.model_train_name={s.model_train_name}",
        f"export.model.nemo_file={s.model_file}",
        f"{deployment}.model_name={session.model_name}",
        f"{deployment}.max_batch_size={max(s.batch_sizes)}",
        f"{deployment}.max_queue_delay_microseconds=0",
        # Every request the benchmark sends must be served, however long it generates.
        f"{deployment}.max_request_tokens={max(s.batch_sizes) * s.beam_width * s.output_len}",
        f"{generation}.tokens_to_generate={s.output_len}",
        f"{generation}.top_k={s.topk}",
        f"{generation}.top_p={s.topp}",
        f"{generation}.beam_width={s.beam_width}",
        f"{generation}.random_seed={SEED}",
    ]


def export_dir(session: Session) -> Path:
    return session.folder / session.settings.model_train_name / "export"


def _serve_and_measure(session: Session) -> list[Point]:
    from launcher_scripts.ports import free_port

    settings = session.settings
    http_port = free_port()
    log = session.folder / "serve.log"
    argv = [
        sys.executable,
        "-m",
        "launcher_scripts",
        "serve",
        str(export_dir(session)),
        f"--http-port={http_port}",
        f"--grpc-port={free_port()}",
        f"--ready-timeout={settings.time_limit_s}",
    ]
    deadline = time.monotonic() + settings.time_limit_s
    server = start(argv, log, session.root, session.env)
    try:
        if not _wait_ready(server, http_port, deadline):
            if server.poll() is None:
                limit = settings.time_limit_s
                return _all_failed(session, f"timeout: the server was not ready in {limit} s")
            why = f"exit code {server.returncode}"
            return _all_failed(session, f"failed: serve ({why}): {last_error_line(log)}")
        return [
            _measure_batch(session, http_port, batch, deadline) for batch in settings.batch_sizes
        ]
    finally:
        # serve passes SIGINT on to tritonserver and waits for it.
        stop(server, signal.SIGINT)


def _wait_ready(server: Any, http_port: int, deadline: float) -> bool:
    url = f"http://127.0.0.1:{http_port}/v2/health/ready"
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.25)
    return False


def _measure_batch(session: Session, http_port: int, batch: int, deadline: float) -> Point:
    settings = session.settings
    prompts = list(session.prompts[:batch])
    latencies, tokens = [], []
    try:
        _infer(session, http_port, prompts, deadline)  # warm-up
        for _ in range(settings.repeats):
            begin = time.perf_counter()
            texts, reasons = _infer(session, http_port, prompts, deadline)
            latencies.append(time.perf_counter() - begin)
            tokens.append(_generated(session, prompts, texts, reasons))
    except TimeoutError:
        status = f"timeout: run.time_limit ({settings.time_limit_s} s) reached"
        return Point(TRITON, 1, 1, batch, status=status, log=str(session.folder / "serve.log"))
    except _RequestFailed as error:
        return Point(TRITON, 1, 1, batch, status=f"failed: {error}", log=str(session.folder))
    return Point(
        TRITON,
        1,
        1,
        batch,
        latencies_s=tuple(latencies),
        generated_tokens=int(statistics.median(tokens)),
        rows_ended_early=sum(reason != "length" for reason in reasons),
        log=str(session.folder / "serve.log"),
    )


class _RequestFailed(Exception):
    """Triton answered with an error, or not at all."""


def _infer(
    session: Session, http_port: int, prompts: list[str], deadline: float
) -> tuple[list[str], list[str]]:
    """One request of len(prompts) rows; the texts and finish reasons."""
    s = session.settings
    rows = len(prompts)

    def column(name: str, datatype: str, value: Any) -> dict[str, Any]:
        return {"name": name, "shape": [rows, 1], "datatype": datatype, "data": [value] * rows}

    body = {
        "inputs": [
            {"name": "text_input", "shape": [rows, 1], "datatype": "BYTES", "data": prompts},
            column("tokens_to_generate", "INT32", s.output_len),
            column("top_k", "INT32", s.topk),
            column("top_p", "FP32", s.topp),
            column("beam_width", "INT32", s.beam_width),
            column("random_seed", "UINT64", SEED),
        ]
    }
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/v2/models/{session.model_name}/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=remaining) as response:
            outputs = json.loads(response.read())["outputs"]
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")
        raise _RequestFailed(f"HTTP {error.code}: {detail[:300]}") from None
    except urllib.error.URLError as error:
        if isinstance(error.reason, TimeoutError):
            raise TimeoutError from None
        raise _RequestFailed(f"no answer from the server: {error.reason}") from None
    except ConnectionError as error:
        raise _RequestFailed(f"no answer from the server: {error}") from None
    data = {output["name"]: output["data"] for output in outputs}
    return list(data["text_output"]), list(data["finish_reason"])


def _generated(session: Session, prompts: list[str], texts: list[str], reasons: list[str]) -> int:
    output_len = session.settings.output_len
    return sum(
        output_len if reason == "length" else continuation_tokens(session.tokenizer, p, t)
        for p, t, reason in zip(prompts, texts, reasons, strict=True)
    )


def _all_failed(session: Session, status: str) -> list[Point]:
    log = str(session.folder)
    return [
        Point(TRITON, 1, 1, batch, status=status, log=log) for batch in session.settings.batch_sizes
    ]
