"""Export to a Triton model repository and serve it with a real Triton server: tritonclient's
greedy text equals in-process generation, streaming joins to the same text, and bad requests
get clear errors while the server keeps serving.

Needs the server `python3 -m launcher_scripts install-triton` installs (.ci/run does); without
it these tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher_scripts.ports import free_port
from tests.conftest import REPO

PROMPTS = ["The history of", "In the morning the", "A small village near the river was"]
ONE_THREAD = os.environ | {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def server(exported: Path, triton_python: Path) -> Iterator[tuple[int, int]]:
    http_port, grpc_port = free_port(), free_port()
    log = exported / "serve.log"
    with log.open("w") as output:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "launcher_scripts",
                "serve",
                str(exported),
                f"--http-port={http_port}",
                f"--grpc-port={grpc_port}",
            ],
            stdout=output,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=ONE_THREAD,
        )
    try:
        deadline = time.monotonic() + 300
        while "ready: models" not in log.read_text():
            assert process.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        yield http_port, grpc_port
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert (
        "tritonserver"
        not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.split(
            str(exported)
        )[0][-200:]
    ), "the server outlived serve"


def in_process(model: Path, tmp_path: Path, tokens: int, *overrides: str) -> list[str]:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.scripts.generate_text",
            str(model),
            str(prompts),
            str(tokens),
            *overrides,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ONE_THREAD,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_export_writes_a_repository_that_the_job_checked(exported: Path) -> None:
    repository = exported / "model_repo"
    assert sorted(p.name for p in repository.iterdir()) == ["gpt3_tiny", "gpt3_tiny_stream"]
    config = (repository / "gpt3_tiny" / "config.pbtxt").read_text()
    assert 'backend: "python"' in config and "dynamic_batching" in config
    assert "decoupled: true" in (repository / "gpt3_tiny_stream" / "config.pbtxt").read_text()
    assert (repository / "gpt3_tiny" / "1" / "model.nemo").is_file()
    check = json.loads((exported / "check.json").read_text())
    assert check["text"] and check["finish_reason"] in ("length", "stop", "eod")


def test_triton_serves_what_in_process_generation_gives(
    server: tuple[int, int], triton_python: Path, tiny_portable: Path, tmp_path: Path
) -> None:
    http_port, grpc_port = server
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    result = subprocess.run(
        [
            str(triton_python),
            "-m",
            "tests.scripts.triton_client_check",
            "gpt3_tiny",
            str(http_port),
            str(grpc_port),
            str(prompts),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    served = json.loads(result.stdout.splitlines()[-1])

    greedy = in_process(tiny_portable, tmp_path, 12)
    assert all(greedy)
    assert served["http_batch"] == greedy  # one request of three rows
    assert served["http_single"] == greedy  # three requests
    assert served["grpc"] == greedy
    assert "".join(served["stream_pieces"]) == greedy[0]
    assert len(served["stream_pieces"]) > 1  # it really streamed
    assert served["http_beam"] == in_process(tiny_portable, tmp_path, 8, "beam_width=3")[:1]
    first, second = served["http_sampled"]
    assert first == second  # the same seed gives the same text
    text, reason = served["http_stop"][0].rsplit("|", 1)
    assert "." not in text
    assert reason == "stop" or (reason in ("length", "eod") and "." not in greedy[0])

    errors = served["errors"]
    assert "text_input is required" in errors["missing_text"]
    assert "data-type is 'FP32'" in errors["wrong_dtype"] and "INT32" in errors["wrong_dtype"]
    assert "tokens_to_generate" in errors["too_many_tokens"]
    assert "128 positions" in errors["too_many_tokens"]
    assert "top_p" in errors["bad_top_p"]
    assert "beam_width" in errors["stream_beam"]
    assert served["http_after_errors"] == greedy[:1]


def test_serve_explains_what_is_missing(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "launcher_scripts", "serve", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {tmp_path} holds no Triton model repository (no */config.pbtxt): pass the "
        "export stage's results directory or its model_repo folder"
    ]
