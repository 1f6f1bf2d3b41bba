"""Export to a Triton model repository and serve it with a real Triton server: tritonclient's
greedy text equals in-process generation, streaming joins to the same text, and bad requests
get clear errors while the server keeps serving.

Needs the server `python3 -m launcher_scripts install-triton` installs (.ci/run does); without
it these tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher_scripts.jobs.export.install import up_to_date
from tests.support import REPO
from tests.support.commands import ONE_THREAD, assert_one_line_error, run_main
from tests.support.triton import post, serves_like_in_process, triton_server

PROMPTS = ["The history of", "In the morning the", "A small village near the river was"]


@pytest.fixture(scope="module")
def server(exported: Path, triton_python: Path) -> Iterator[tuple[int, int]]:
    with triton_server(exported) as ports:
        yield ports


def test_export_writes_a_repository_that_the_job_checked(exported: Path) -> None:
    repository = exported / "model_repo"
    assert sorted(p.name for p in repository.iterdir()) == [
        "ensemble",
        "gpt3_tiny",
        "gpt3_tiny_stream",
        "gpt3_tiny_tokens",
        "postprocessing",
        "preprocessing",
    ]
    config = (repository / "gpt3_tiny" / "config.pbtxt").read_text()
    assert 'backend: "python"' in config and "dynamic_batching" in config
    assert "decoupled: true" in (repository / "gpt3_tiny_stream" / "config.pbtxt").read_text()
    assert (repository / "gpt3_tiny" / "1" / "model.nemo").is_file()
    check = json.loads((exported / "check.json").read_text())
    assert check["text"] and check["finish_reason"] in ("length", "stop", "eod")


def test_triton_serves_what_in_process_generation_gives(
    server: tuple[int, int], triton_python: Path, tiny_portable: Path, tmp_path: Path
) -> None:
    served, _greedy = serves_like_in_process(
        triton_python, "gpt3_tiny", server, tiny_portable, PROMPTS, tmp_path
    )

    errors = served["errors"]
    assert "text_input is required" in errors["missing_text"]
    assert "data-type is 'FP32'" in errors["wrong_dtype"] and "INT32" in errors["wrong_dtype"]
    assert "tokens_to_generate" in errors["too_many_tokens"]
    assert "128 positions" in errors["too_many_tokens"]
    assert "top_p" in errors["bad_top_p"]
    assert "beam_width" in errors["stream_beam"]


def test_the_ensemble_s_steps_fit_the_models_they_name(exported: Path) -> None:
    """Every input and output the ensemble maps is one its step's model has, and every input
    a step needs is an ensemble input or an earlier step's output (Triton refuses to load the
    ensemble otherwise, naming neither the step nor the fix)."""
    import re

    from launcher_scripts.jobs.export.repository import config_inputs

    repository = exported / "model_repo"
    ensemble = (repository / "ensemble" / "config.pbtxt").read_text()
    available = set(config_inputs(ensemble))
    steps = re.findall(r"model_name: \"(\w+)\"(.*?)\n    }", ensemble, re.DOTALL)
    assert [name for name, _ in steps] == ["preprocessing", "gpt3_tiny_tokens", "postprocessing"]
    for name, body in steps:
        config = (repository / name / "config.pbtxt").read_text()
        inputs = config_inputs(config)
        outputs = re.findall(r'name: "(\w+)"', config.split("output [", 1)[1])
        mapped = dict(re.findall(r'input_map { key: "(\w+)" value: "(\w+)" }', body))
        assert set(mapped) <= set(inputs) and set(mapped.values()) <= available, name
        required = {n for n in inputs if f'name: "{n}"\n    data_type' in config}
        required -= set(re.findall(r'name: "(\w+)"\n[^}]*optional: true', config))
        assert required <= set(mapped), (name, required - set(mapped))
        produced = dict(re.findall(r'output_map { key: "(\w+)" value: "(\w+)" }', body))
        assert set(produced) <= set(outputs), name
        available |= set(produced.values())


def test_the_ensemble_answers_text_as_the_text_model_does(server: tuple[int, int]) -> None:
    """Text in, through preprocessing, the model on ids and postprocessing: the text model's
    greedy text, and the generated ids that spell it."""
    port = server[0]
    greedy = {"tokens_to_generate": 12, "top_k": 1}
    texts, ids = [], []
    for prompt in PROMPTS:
        status, plain = post(
            port, "/v2/models/gpt3_tiny/generate", {"text_input": prompt, **greedy}
        )
        assert status == 200, plain
        status, chained = post(
            port, "/v2/models/ensemble/generate", {"text_input": prompt, **greedy}
        )
        assert status == 200, chained
        assert chained["text_output"] == plain["text_output"]
        assert chained["sequence_length"] == len(chained["output_ids"]) <= 12
        texts.append(plain["text_output"])
        ids.append(chained["output_ids"])
    # The model on ids, asked directly with the prompts' ids, generates the same ids.
    status, prompt_ids = post(port, "/v2/models/preprocessing/infer", text_rows(PROMPTS))
    assert status == 200, prompt_ids
    outputs = {o["name"]: o for o in prompt_ids["outputs"]}
    request = {
        "inputs": [
            {**outputs["input_ids"], "datatype": "INT32"},
            {**outputs["input_lengths"], "datatype": "INT32"},
            *[
                {"name": k, "datatype": "INT32", "shape": [len(PROMPTS), 1], "data": [v] * 3}
                for k, v in greedy.items()
            ],
        ]
    }
    status, on_ids = post(port, "/v2/models/gpt3_tiny_tokens/infer", request)
    assert status == 200, on_ids
    outputs = {o["name"]: o for o in on_ids["outputs"]}
    width = outputs["output_ids"]["shape"][1]
    rows = [outputs["output_ids"]["data"][i * width : (i + 1) * width] for i in range(3)]
    lengths = outputs["sequence_length"]["data"]
    assert [row[:length] for row, length in zip(rows, lengths, strict=True)] == ids
    assert all(set(row[length:]) <= {-1} for row, length in zip(rows, lengths, strict=True))


def test_bad_token_ids_get_a_400_naming_the_id_and_the_vocabulary(
    server: tuple[int, int],
) -> None:
    port = server[0]
    ids = {"name": "input_ids", "datatype": "INT32", "shape": [1, 2], "data": [[5, 8000]]}
    status, answer = post(port, "/v2/models/gpt3_tiny_tokens/infer", {"inputs": [ids]})
    assert status == 400
    assert (
        "token id 8000 at position 1 is not an id of the model's tokenizer (0 to 7999)"
        in (answer["error"])
    )
    lengths = {"name": "input_lengths", "datatype": "INT32", "shape": [1, 1], "data": [[3]]}
    status, answer = post(port, "/v2/models/gpt3_tiny_tokens/infer", {"inputs": [ids, lengths]})
    assert status == 400 and "input_lengths 3 is not within the row's 2 ids" in answer["error"]
    status, answer = post(port, "/v2/models/gpt3_tiny_tokens/generate", {"text_input": "A"})
    assert status == 400
    assert answer["error"].startswith("unknown key 'text_input': the inputs are input_ids,")


def test_the_client_command_prints_the_ensemble_s_text(server: tuple[int, int]) -> None:
    """The reference's end-to-end client: prompts in, each prompt and its text out."""
    from tests.support.commands import run_ops

    port = server[0]
    status, plain = post(
        port, "/v2/models/gpt3_tiny/generate", {"text_input": PROMPTS[0], "tokens_to_generate": 8}
    )
    assert status == 200, plain
    result = run_ops("client", f"localhost:{port}", PROMPTS[0], "--tokens-to-generate=8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"{PROMPTS[0]}{plain['text_output']}  [{plain['finish_reason']}]"
    ]
    bad = run_ops("client", f"localhost:{port}", "A", "--top-k=-1")
    assert_one_line_error(bad, "top_k: -1 is not allowed")


def text_rows(prompts: list[str]) -> dict[str, Any]:
    return {
        "inputs": [
            {"name": "text_input", "datatype": "BYTES", "shape": [len(prompts), 1], "data": prompts}
        ]
    }


def test_install_triton_again_installs_nothing_and_says_so(triton_python: Path) -> None:
    """A second `install-triton` (every CI run makes one) is one line, not pip's forty lines of
    "Requirement already satisfied"."""
    again = subprocess.run(
        [sys.executable, "-m", "launcher_scripts", "install-triton"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("already installed in "), again.stdout
    assert "Requirement already satisfied" not in again.stdout + again.stderr
    assert len(again.stdout.splitlines()) == 2, again.stdout


def test_a_venv_without_the_server_is_not_up_to_date(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    assert not up_to_date(venv)


def test_serve_refuses_no_slots_in_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "launcher_scripts", "serve", str(tmp_path), "--slots", "0"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == "error: --slots 0: give 1 or more (sequences at once)"


def test_serve_explains_what_is_missing(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "launcher_scripts", "serve", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {tmp_path} holds no Triton model repository (no */config.pbtxt): pass the "
        "export stage's results directory or its model_repo folder"
    ]


# ---------------------------------------------------------------------------------------------
# Bad requests: a 400 naming what is wrong, and the server keeps serving.

GOOD_PROMPT = "The history of"
WRONG_JSON_VALUES = {
    "INT32": ["x", 1.5, 2**31, -(2**31) - 1, None, True, {"a": 1}],
    "UINT64": ["x", 1.5, -1, 2**64, None, True],
    "FP32": ["x", None, True, {"a": 1}],
    "BYTES": [1, 2.5, None, True, {"a": 1}],
}
# JSON-typed right but outside what generation allows (GenerationParams.check).
OUT_OF_RANGE = {
    "tokens_to_generate": [0, -5],
    "temperature": [-1.0],
    "top_k": [-1],
    "top_p": [1.5, -0.1],
    "repetition_penalty": [0.0, -2.0],
    "random_seed": [2**63],
    "beam_width": [0, -3],
}


def infer_body(prompts: list[str], **inputs: tuple[str, object]) -> dict:
    tensors = [
        {"name": "text_input", "shape": [len(prompts), 1], "datatype": "BYTES", "data": prompts}
    ]
    for name, (datatype, value) in inputs.items():
        tensors.append(
            {
                "name": name,
                "shape": [len(prompts), 1],
                "datatype": datatype,
                "data": [value] * len(prompts),
            }
        )
    return {"inputs": tensors}


def served_text(port: int) -> str:
    """A valid request's text: the server still answers."""
    status, answer = post(
        port, "/v2/models/gpt3_tiny/generate", {"text_input": GOOD_PROMPT, "tokens_to_generate": 6}
    )
    assert status == 200, answer
    return answer["text_output"]


def stub_processes() -> set[int]:
    """The Python-backend processes that hold the models (one per model instance)."""
    table = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return {int(line.split()[0]) for line in table.splitlines() if "python_backend_stub" in line}


def test_every_malformed_request_gets_a_400_naming_the_problem(server: tuple[int, int]) -> None:
    from launcher_scripts.recipes.triton_interface import PARAMETERS

    port = server[0]
    expected = served_text(port)
    stubs = stub_processes()
    infer, generate = "/v2/models/gpt3_tiny/infer", "/v2/models/gpt3_tiny/generate"
    cases: list[tuple[str, str, bytes | object, str]] = []
    for parameter in PARAMETERS:
        for value in WRONG_JSON_VALUES[parameter.client_type]:
            body = infer_body([GOOD_PROMPT], **{parameter.name: (parameter.client_type, value)})
            cases.append((f"{parameter.name}={value!r}", infer, body, parameter.name))
            listed = [value] if parameter.many else value
            generate_body = {"text_input": GOOD_PROMPT, parameter.name: listed}
            cases.append(
                (f"generate {parameter.name}={value!r}", generate, generate_body, parameter.name)
            )
        for value in OUT_OF_RANGE.get(parameter.name, []):
            body = infer_body([GOOD_PROMPT], **{parameter.name: (parameter.client_type, value)})
            cases.append((f"{parameter.name}={value!r}", infer, body, parameter.name))
    good = json.dumps(infer_body([GOOD_PROMPT], tokens_to_generate=("INT32", 4))).encode()
    for cut in range(1, len(good), max(1, len(good) // 12)):
        cases.append((f"cut at {cut}", infer, good[:cut], "JSON"))
    for where in (infer, generate):
        cases += [
            ("empty", where, b"", "empty"),
            ("a list", where, [1], "list"),
            ("not UTF-8", where, b"\xff\xfe{}", "UTF-8"),
            ("NaN", where, b'{"inputs": NaN}', "NaN"),
        ]
    cases += [
        ("inputs not a list", infer, {"inputs": "x"}, "inputs"),
        ("an input not an object", infer, {"inputs": [1]}, "inputs[0]"),
        (
            "no name",
            infer,
            {"inputs": [{"shape": [1], "datatype": "BYTES", "data": ["a"]}]},
            "name",
        ),
        (
            "shape of strings",
            infer,
            {
                "inputs": [
                    {"name": "text_input", "shape": ["1"], "datatype": "BYTES", "data": ["a"]}
                ]
            },
            "shape",
        ),
        ("text not a string", generate, {"text_input": 5}, "text_input"),
    ]
    for what, path, body, named in cases:
        status, answer = post(port, path, body)
        assert status == 400, (what, status, answer)
        assert named in answer["error"], (what, answer)
    assert stub_processes() == stubs
    assert served_text(port) == expected


def test_a_request_needing_more_sequences_than_the_server_holds_is_refused(
    server: tuple[int, int],
) -> None:
    """beam_width=100000 grew the model process until the kernel killed it, and every later
    request failed. The model server holds a fixed number of sequences (serve --slots, 16
    here): a request needing more is refused saying what fits, and the next one is served."""
    port = server[0]
    expected = served_text(port)
    stubs = stub_processes()
    infer, generate = "/v2/models/gpt3_tiny/infer", "/v2/models/gpt3_tiny/generate"
    cases = [
        (generate, {"text_input": GOOD_PROMPT, "beam_width": 100, "tokens_to_generate": 4}),
        # batch x beams: eight prompts (the export's max_batch_size), three beams each
        (infer, infer_body([GOOD_PROMPT] * 8, beam_width=("INT32", 3))),
    ]
    for path, body in cases:
        status, answer = post(port, path, body)
        assert status == 400, (body, answer)
        message = answer["error"]
        assert "beam_width" in message and "this server holds 16" in message, message
        assert served_text(port) == expected
    status, answer = post(
        port,
        "/v2/models/gpt3_tiny_stream/generate_stream",
        {"text_input": GOOD_PROMPT, "beam_width": 100},
    )
    assert "streaming needs beam_width 1" in json.dumps(answer), answer
    assert stub_processes() == stubs, "a model process was restarted"


def test_the_memory_estimate_covers_a_forward_pass(tiny_portable: Path) -> None:
    """What memory.py says a forward pass needs is at least what the process's resident size
    grows by (its peak, read from the kernel), and not far above the logits it must hold."""
    sizes = ["64x128", "256x32", "16x128", "512x8"]
    result = subprocess.run(
        [sys.executable, "-m", "tests.scripts.forward_memory", str(tiny_portable), *sizes],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ONE_THREAD,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for row in json.loads(result.stdout.splitlines()[-1]):
        logits = row["rows"] * row["width"] * 8064 * 4  # float32, the padded vocabulary
        assert row["measured"] <= row["estimate"] <= 1.6 * 2 * logits, row


# ---------------------------------------------------------------------------------------------
# Requests the front answers itself, and the limit on a request's generation.


def misspellings(name: str) -> list[str]:
    return [name[:-2] + name[-1] + name[-2], name[0] + name[2:], name.upper()]


def test_a_misspelled_input_gets_a_400_saying_what_it_resembles() -> None:
    """`beam_widht` in a generate request was ignored: the request ran with the default."""
    from launcher_scripts.jobs.export.http_front import INPUT_TYPES, BadRequest, check_request

    for name in INPUT_TYPES:
        for wrong in misspellings(name):
            generate = {"text_input": GOOD_PROMPT, wrong: 1}
            tensor = {"name": wrong, "shape": [1, 1], "datatype": "INT32", "data": [1]}
            infer = infer_body([GOOD_PROMPT])
            infer["inputs"].append(tensor)
            for path, body in (("generate", generate), ("infer", infer)):
                with pytest.raises(BadRequest, match=f"did you mean '{name}'") as raised:
                    check_request(f"/v2/models/gpt3_tiny/{path}", json.dumps(body).encode(), {})
                assert repr(wrong) in str(raised.value)
    with pytest.raises(BadRequest, match="the inputs are text_input, tokens_to_generate"):
        check_request("/v2/models/m/generate", b'{"text_input": "a", "colour": 1}', {})


@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_a_list_of_prompts_to_generate_says_how_to_send_several(endpoint: str) -> None:
    """Triton answered "batch size does not match" to a list of prompts."""
    from launcher_scripts.jobs.export.http_front import BadRequest, check_request

    body = json.dumps({"text_input": ["a", "b", "c"], "tokens_to_generate": 4}).encode()
    with pytest.raises(BadRequest) as raised:
        check_request(f"/v2/models/gpt3_tiny/{endpoint}", body, {})
    message = str(raised.value)
    assert "one prompt" in message and "send a request each" in message
    assert "/v2/models/gpt3_tiny/infer with text_input of shape [3, 1]" in message
    check_request("/v2/models/gpt3_tiny/generate", b'{"text_input": ["a"]}', {})


def test_an_infer_input_without_a_row_per_prompt_says_what_shape_to_send() -> None:
    """Triton answered "batch size does not match other inputs" to prompts of shape [3, 1]
    with tokens_to_generate of shape [1, 1]."""
    from launcher_scripts.jobs.export.http_front import BadRequest, check_request
    from launcher_scripts.recipes.triton_interface import PARAMETERS

    for parameter in PARAMETERS:
        body = infer_body(["a", "b", "c"])
        value = "x" if parameter.client_type == "BYTES" else 1
        tensor = {"name": parameter.name, "shape": [1, 1], "datatype": parameter.client_type}
        body["inputs"].append(tensor | {"data": [value]})
        with pytest.raises(BadRequest) as raised:
            check_request("/v2/models/gpt3_tiny/infer", json.dumps(body).encode(), {})
        message = str(raised.value)
        assert f"input '{parameter.name}' has shape [1, 1] for 3 prompt(s)" in message
        assert "shape [3, 1]" in message


def test_a_request_over_the_generation_limit_is_refused_saying_what_fits() -> None:
    """beam_width=1000 held the server for three minutes while other clients waited."""
    from launcher_scripts.jobs.inference.model_server import too_many_tokens
    from launcher_scripts.recipes.generation_params import GenerationParams

    assert too_many_tokens(2, GenerationParams(beam_width=64, tokens_to_generate=32), 4096) is None
    assert (
        too_many_tokens(1, GenerationParams(beam_width=1000, tokens_to_generate=32), None) is None
    )
    for prompts, params, advice in [
        (1, GenerationParams(beam_width=1000, tokens_to_generate=32), "beam_width to at most 128"),
        (4, GenerationParams(tokens_to_generate=2000), "lower tokens_to_generate to at most 1024"),
    ]:
        message = too_many_tokens(prompts, params, 4096)
        assert message is not None and message.endswith(advice), message
        assert "more than the 4096" in message and "max_request_tokens" in message
    message = too_many_tokens(8, GenerationParams(tokens_to_generate=1), 4)
    assert message is not None and message.endswith("send fewer prompts per request")


def test_the_limit_is_the_recipe_s_and_preflight_checks_it(tmp_path: Path) -> None:
    config = plain_config("m", max_request_tokens=512)
    assert 'key: "max_request_tokens"\n  value: { string_value: "512" }' in config
    result = run_main(
        "stages=[export]",
        f"base_results_dir={tmp_path}",
        f"export.model.nemo_file={tmp_path / 'x.nemo'}",
        "export.triton_deployment.max_request_tokens=0",
    )
    assert_one_line_error(result, "export.triton_deployment.max_request_tokens")


def test_the_front_marks_the_request_of_a_client_that_went_away_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request runs on after its client gave up: the front must tell the model, which reads
    the mark between generation steps (here a stand-in backend reads it as the model does)."""
    import socket
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from launcher_scripts.jobs.export.http_front import Front
    from launcher_scripts.jobs.export.triton_model import cancellation
    from launcher_scripts.recipes.triton_interface import (
        CANCELLED_REQUESTS_VARIABLE,
        REQUEST_ID_HEADER,
    )

    monkeypatch.setenv(CANCELLED_REQUESTS_VARIABLE, str(tmp_path))
    seen: dict[str, object] = {}
    answered = threading.Event()

    class Model(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            request_id = body["parameters"][REQUEST_ID_HEADER]
            seen["id"], seen["prompt"] = request_id, body["text_input"]
            cancelled = cancellation(request_id, lambda: False)
            for _step in range(3000):  # a long generation, checked before each step
                if cancelled():
                    seen["cancelled"] = True
                    break
                time.sleep(0.1)
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")
            answered.set()

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    model = ThreadingHTTPServer(("127.0.0.1", 0), Model)
    threading.Thread(target=model.serve_forever, daemon=True).start()
    front = Front(0, model.server_address[1], tmp_path)
    front.start()
    try:
        body = json.dumps({"text_input": GOOD_PROMPT, "beam_width": 64}).encode()
        client = socket.create_connection(("127.0.0.1", front.server_address[1]))
        client.sendall(
            b"POST /v2/models/gpt3_tiny/generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
            b"\r\n%s" % (len(body), body)
        )
        client.close()  # the client gives up
        answered.wait()
    finally:
        front.stop()
        model.shutdown()
    assert seen["prompt"] == GOOD_PROMPT
    assert seen.get("cancelled") is True, seen


def test_a_gone_client_s_request_is_dropped_and_ctrl_c_stops_the_server_in_one_line(
    exported: Path, triton_python: Path, tmp_path: Path
) -> None:
    """On a real server: a request within the memory bound but over the generation limit is
    refused; a big allowed request whose client closes its connection is cancelled (the model
    says so in the server's log) and the next request is answered; and Ctrl-C, as a terminal
    sends it to the whole process group, stops the server with one line and no error (it
    printed "Internal - Exit timeout expired" while a request was generating)."""
    import os
    import re
    import shutil
    import signal
    import socket

    from tests.support.commands import ctrl_c_as_in_a_terminal
    from tests.support.triton import logged, model_server_processes, started_serve

    export = tmp_path / "export"
    shutil.copytree(exported, export, copy_function=os.link)
    log = tmp_path / "serve.log"
    serve = started_serve(
        export,
        log,
        "--http-port=auto",
        "--grpc-port=auto",
        "--slots=128",  # room for the 128 beams below
        start_new_session=True,  # its own process group, as a terminal's job
        preexec_fn=ctrl_c_as_in_a_terminal,
    )
    client = None
    try:
        port = int(re.search(r"http://localhost:(\d+)", log.read_text()).group(1))
        generate = "/v2/models/gpt3_tiny/generate"
        status, answer = post(port, generate, {"text_input": GOOD_PROMPT, "beam_width": 1000})
        assert status == 400 and "max_request_tokens" in answer["error"], answer

        # The model's processes are stopped while the client comes and goes, so its request
        # cannot be answered before the hang-up is seen (on a fast machine it would be).
        body = json.dumps({"text_input": GOOD_PROMPT, "beam_width": 128}).encode()
        model = model_server_processes(serve.pid)
        for process in model:
            process.suspend()
        try:
            client = socket.create_connection(("127.0.0.1", port))
            client.sendall(
                b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                % (generate.encode(), len(body), body)
            )
            client.close()
            cancelled = r"gpt3_tiny: cancelled request\(s\) \w+: the client went away"
            logged(log, cancelled, serve)
        finally:
            for process in model:
                process.resume()
        assert served_text(port)

        # Ctrl-C with a long request in flight: its client waits for the answer.
        client = socket.create_connection(("127.0.0.1", port))
        client.sendall(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
            % (generate.encode(), len(body), body)
        )
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        code = serve.wait(timeout=300)
        if client is not None:
            client.close()
    after_ready = log.read_text().split("ready: models", 1)[1]
    assert code == 0, after_ready[-3000:]
    assert after_ready.rstrip().endswith("stopped: the Triton server has shut down"), after_ready
    assert "Exit timeout expired" not in after_ready
    assert not re.search(r"^(E\d{4}|error)", after_ready, re.MULTILINE), after_ready[-3000:]


# ---------------------------------------------------------------------------------------------
# The reference's export at TP=2: served by two processes behind one Triton.


def test_the_reference_s_tp2_export_serves_what_tp1_serves(
    server: tuple[int, int], tp2_export: Path, triton_python: Path
) -> None:
    """The model server runs the model on two processes, and Triton answers as from one."""
    config = (tp2_export / "model_repo" / "gpt3_tiny" / "config.pbtxt").read_text()
    assert 'key: "tensor_model_parallel_size"\n  value: { string_value: "2" }' in config
    bodies = [
        {"text_input": GOOD_PROMPT, "tokens_to_generate": 12},
        {"text_input": "The history of", "tokens_to_generate": 8, "beam_width": 3},
    ]
    generate = "/v2/models/gpt3_tiny/generate"
    one = [post(server[0], generate, body) for body in bodies]
    with triton_server(tp2_export) as ports:
        two = [post(ports[0], generate, body) for body in bodies]
        log = (tp2_export / "serve.log").read_text()
    assert "TP=2 x PP=1 (2 process(es) on this node)" in log, log[-3000:]
    assert two == one and all(status == 200 for status, _ in one), (one, two)


def test_a_model_rank_that_dies_stops_the_server_in_one_line(
    tp2_export: Path, triton_python: Path, tmp_path: Path
) -> None:
    """A model server rank killed: torchrun ends the other, and serve stops Triton and says so
    in one line instead of leaving clients waiting."""
    import os
    import re
    import shutil
    import signal

    from tests.support.triton import model_server_processes, started_serve

    export = tmp_path / "export"
    shutil.copytree(tp2_export, export, copy_function=os.link)
    log = tmp_path / "serve.log"
    serve = started_serve(
        export, log, "--http-port=auto", "--grpc-port=auto", start_new_session=True
    )
    try:
        ranks = {
            int(process.environ()["LOCAL_RANK"]): process.pid
            for process in model_server_processes(serve.pid)
            if "LOCAL_RANK" in process.environ()  # the ranks, not torchrun
        }
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGKILL)
        code = serve.wait(timeout=300)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 1, text[-3000:]
    errors = re.findall(r"^error: .*$", text, re.MULTILINE)
    assert len(errors) == 1 and errors[0].startswith("error: the model server exited with code")
    assert errors[0].endswith("(a model rank failed; its log is above): stopping the Triton server")


@pytest.mark.parametrize(
    ("override", "key", "problem"),
    [
        ("export.model.tensor_model_parallel_size=3", "export.model.tensor_model_parallel_size",
         "3 does not divide"),
        ("export.triton_deployment.pipeline_model_parallel_size=3",
         "export.triton_deployment.pipeline_model_parallel_size", "3 does not divide"),
        ("export.model.tensor_model_parallel_size=0", "export.model.tensor_model_parallel_size",
         ""),
    ],
)  # fmt: skip
def test_a_served_layout_that_does_not_divide_the_model_is_one_line(
    tiny_portable: Path, tmp_path: Path, override: str, key: str, problem: str
) -> None:
    result = run_main(
        "stages=[export]",
        f"base_results_dir={tmp_path}",
        f"export.model.nemo_file={tiny_portable}",
        override,
    )
    assert_one_line_error(result, key, problem)
    assert not (tmp_path / "gpt3_tiny" / "export").exists()


def test_a_slurm_server_with_fewer_gpus_than_model_ranks_is_one_line(
    exported: Path, tmp_path: Path
) -> None:
    import os
    import shutil

    from launcher_scripts.config.compose import compose_config
    from launcher_scripts.errors import ConfigError
    from launcher_scripts.serving import serve_job

    export = tmp_path / "export"
    shutil.copytree(exported, export, copy_function=os.link)
    config = export / "model_repo" / "gpt3_tiny" / "config.pbtxt"
    text = config.read_text()
    config.write_text(
        text.replace(
            'key: "tensor_model_parallel_size"\n  value: { string_value: "1" }',
            'key: "tensor_model_parallel_size"\n  value: { string_value: "2" }',
        )
    )
    root = compose_config(["cluster_type=bcm", "export.serving.gpus_per_node=1"])
    with pytest.raises(ConfigError) as error:
        serve_job(root, export)
    assert error.value.key == "export.serving.gpus_per_node"
    message = str(error.value)
    assert "TP=2 x PP=1: 2 model processes" in message and "Set it to 2" in message
    assert "or export.serving.nodes to 2" in message
    cpu = compose_config(["cluster_type=bcm", "export.serving.gpus_per_node=0"])
    assert serve_job(cpu, export).resources.gpus_per_node == 0
    # Across nodes, the step's tasks are the ranks; three nodes cannot share two ranks.
    spread = serve_job(
        compose_config(["cluster_type=bcm", "export.serving.nodes=2"]), export
    ).resources
    assert (spread.nodes, spread.ntasks_per_node, spread.gpus_per_node) == (2, 1, 1)
    with pytest.raises(ConfigError) as error:
        serve_job(compose_config(["cluster_type=bcm", "export.serving.nodes=3"]), export)
    assert error.value.key == "export.serving.nodes"
    assert "2 model processes, which 3 nodes cannot share evenly" in str(error.value)


def plain_config(name: str, max_request_tokens: int = 4096, tensor: int = 1) -> str:
    """The text model's config.pbtxt as the export renders it, with made-up defaults."""
    from launcher_scripts.jobs.export.repository import render_config
    from launcher_scripts.recipes.triton_interface import PARAMETER_NAMES

    defaults = {name: [] if name == "stop_words" else 1 for name in PARAMETER_NAMES}
    return render_config(
        name,
        max_batch_size=8,
        max_queue_delay_microseconds=0,
        decoupled=False,
        model_file="1/model.nemo",
        defaults=defaults,
        max_request_tokens=max_request_tokens,
        tensor=tensor,
    )


def fake_export(folder: Path, tensor: int) -> Path:
    """An export folder whose repository names a model served at TP `tensor` (what rendering
    the server's job reads of it)."""
    model = folder / "model_repo" / "gpt3_126m"
    model.mkdir(parents=True)
    (model / "config.pbtxt").write_text(plain_config("gpt3_126m", tensor=tensor))
    return folder


@pytest.mark.parametrize("backend_name", ["bcm", "bcp", "k8s"])
def test_a_two_node_server_renders_for_each_cluster(
    backend_name: str, update_goldens: bool, tmp_path: Path
) -> None:
    """A TP=2 export served over two nodes, one model rank on each: Slurm's script (two
    tasks), BCP's (torchrun over two replicas) and Kubernetes' manifest (two pods), each
    running the server program on every rank."""
    from launcher_scripts.serving import RENDERED, rendered_server
    from tests.support.golden_cases import GOLDEN, IMAGE, K8S, PATHS, assert_goldens

    export = fake_export(tmp_path / "export", tensor=2)
    overrides = [*PATHS, f"cluster_type={backend_name}", "export.serving.nodes=2"]
    if backend_name == "k8s":
        overrides += [*K8S, f"container={IMAGE}"]
    kind, text = rendered_server(export, overrides)
    assert kind == backend_name
    text = text.replace(str(export), "/results/gpt3_126m/export")
    folder = GOLDEN / backend_name / "serve_tp2_two_nodes"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    assert_goldens(folder, {RENDERED[kind]: text}, backend_name, update_goldens, scratch)
    assert "launcher_scripts.jobs.export.serve" in text


def test_render_writes_the_job_beside_the_export_and_refuses_local(tmp_path: Path) -> None:
    from tests.support.commands import run_ops

    export = fake_export(tmp_path / "export", tensor=1)
    result = run_ops("serve", str(export), "--render", "export.serving.gpus_per_node=0")
    assert result.returncode == 0, result.stderr
    script = export / "serve_submission.sh"
    assert result.stdout.startswith(f"wrote {script}; start it with sbatch {script}.")
    assert "#SBATCH --nodes=1" in script.read_text()
    refused = run_ops("serve", str(export), "--render", "cluster_type=local")
    assert_one_line_error(refused, "cluster_type: is local: a server for this machine starts")
    both = run_ops("serve", str(export), "--render", "--slurm")
    assert both.returncode == 2 and "give one of them" in both.stderr


def test_a_server_spread_over_torchrun_workers_answers_as_tp1(
    exported: Path, tp2_export: Path, triton_python: Path, tmp_path: Path
) -> None:
    """What a two-node BCP or Kubernetes job runs (torchrun's workers each running the server
    program, rank 0 serving and rank 1 a model rank), on one machine: the client gets the
    text the TP=1 export's check generated."""
    import os
    import shutil
    import signal

    from launcher_scripts.ports import free_port
    from tests.support.commands import run_ops
    from tests.support.triton import READY_TIMEOUT, logged

    export = tmp_path / "export"
    shutil.copytree(tp2_export, export, copy_function=os.link)
    check = json.loads((exported / "check.json").read_text())
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2"]
    command += ["-m", "launcher_scripts.jobs.export.serve", str(export)]
    command += [f"--http-port={free_port()}", "--grpc-port=auto"]
    command += [f"--ready-timeout={READY_TIMEOUT}", f"--endpoint-file={export / 'endpoint.json'}"]
    log = tmp_path / "serve.log"
    with log.open("w") as output:
        server = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        logged(log, "ready: models", server, timeout=READY_TIMEOUT)
        assert "TP=2 x PP=1 (2 process(es) spread over the job's nodes)" in log.read_text()
        answer = run_ops("client", str(export), check["prompt"])
        assert answer.returncode == 0, answer.stderr
        assert answer.stdout.splitlines() == [
            f"{check['prompt']}{check['text']}  [{check['finish_reason']}]"
        ]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=300)
