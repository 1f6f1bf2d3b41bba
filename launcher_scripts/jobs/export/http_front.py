"""The HTTP address `serve` gives users: a thin front on Triton's own HTTP endpoint (which then
listens on 127.0.0.1 only) that answers a malformed request with 400 and what is wrong.

Triton's HTTP server reports its request-JSON parse failures as internal errors: HTTP 500 for a
body that is not JSON, or for a value of the wrong JSON type ("Unable to parse 'data': attempt
to access JSON non-signed-integer as signed-integer"), without naming the input. The front
checks an inference or generate request's JSON before Triton sees it: the syntax, the
request's structure, each input's name (a misspelled parameter, which Triton's generate
endpoint ignores, gets a 400 with the name it resembles) and values against its datatype
(type and range). A 500 that Triton's request parsing still returns becomes a 400.
Everything else passes through unchanged, streamed responses (generate_stream) as they come.

A client that disconnects before its answer has come has its request cancelled: the front
tags each inference request with an id (triton_interface.REQUEST_ID_HEADER), watches the
client's connection while the model works, and on a disconnect marks the id cancelled in a
folder the model reads between generation steps, so the server drops the work instead of
running on for nobody while other clients wait.
"""

from __future__ import annotations

import contextlib
import difflib
import http.client
import json
import math
import re
import threading
import uuid
from collections.abc import Iterator, Mapping
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from launcher_scripts.jobs.hangup import HangupWatch
from launcher_scripts.jobs.inference.model_server import answer_lines
from launcher_scripts.recipes.triton_interface import (
    ALL_CANCELLED,
    PARAMETERS,
    REQUEST_ID_HEADER,
    TEXT_INPUT,
)

INFER = re.compile(r"^/v2/models/([^/]+)(/versions/[^/]+)?/infer$")
GENERATE = re.compile(r"^/v2/models/([^/]+)(/versions/[^/]+)?/generate(_stream)?$")
# The datatype of each input the text models take; the front is given every model's own
# (repository.config_inputs), and checks a model it was not told of against these.
INPUT_TYPES = {TEXT_INPUT: "BYTES"} | {p.name: p.client_type for p in PARAMETERS}
# Keys of a generate request that are no input: Triton's own.
GENERATE_KEYS = ("id", "parameters")
# How Triton's HTTP server begins the messages of request-parsing failures it reports as 500.
PARSE_FAILURES = ("failed to parse the request JSON", "Unable to parse", "attempt to ")
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "expect"}
    | {"proxy-authorization", "proxy-authenticate", "content-length", "host"}
)
INTEGER_RANGES = {
    f"INT{bits}": (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) for bits in (8, 16, 32, 64)
}
INTEGER_RANGES |= {f"UINT{bits}": (0, 2**bits - 1) for bits in (8, 16, 32, 64)}
FLOATS = ("FP16", "BF16", "FP32", "FP64")


class BadRequest(ValueError):
    """What is wrong with a request, as the client will read it."""


def check_request(
    path: str,
    body: bytes,
    headers: Mapping[str, str],
    inputs: Mapping[str, Mapping[str, str]] | None = None,
) -> None:
    """Raise BadRequest when an infer or generate request's JSON is not one Triton can take.
    `inputs`: each model's inputs (name -> datatype); a model not in it takes INPUT_TYPES."""
    path = path.split("?", 1)[0]
    if headers.get("Content-Encoding"):  # compressed: Triton decodes and checks it
        return
    found = INFER.match(path) or GENERATE.match(path)
    types = dict((inputs or {}).get(found.group(1), INPUT_TYPES)) if found else INPUT_TYPES
    if INFER.match(path):
        header = headers.get("Inference-Header-Content-Length")
        if header is not None:
            if not header.isdigit() or int(header) > len(body):
                raise BadRequest(
                    f"Inference-Header-Content-Length {header!r} is not a byte count within "
                    f"the {len(body)}-byte body"
                )
            body = body[: int(header)]
        _check_infer(_parse(body), types)
    elif GENERATE.match(path):
        _check_generate(_parse(body), path, types)


def _parse(body: bytes) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BadRequest(f"the request body is not UTF-8 text (byte {error.start})") from None
    if not text.strip():
        raise BadRequest("the request body is empty: send a JSON object")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as error:
        raise BadRequest(
            f"the request body is not valid JSON: {error.msg} at line {error.lineno} column "
            f"{error.colno}"
        ) from None


def _no_constant(name: str) -> None:
    raise BadRequest(f"the request body holds {name}, which is not JSON: send a finite number")


def _check_infer(request: Any, types: Mapping[str, str]) -> None:
    if not isinstance(request, dict):
        raise BadRequest(
            f'the request body is {_kind(request)}; send a JSON object with an "inputs" list '
            "(the KServe v2 inference protocol)"
        )
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise BadRequest(
            '"inputs" must be a non-empty list of objects with name, shape, datatype and data'
        )
    for index, tensor in enumerate(inputs):
        if not isinstance(tensor, dict):
            raise BadRequest(f"inputs[{index}] is {_kind(tensor)}; expected an object")
        name = tensor.get("name")
        if not isinstance(name, str):
            raise BadRequest(f'inputs[{index}]: "name" must be a string')
        if name not in types:
            raise BadRequest(f"input {name!r} is not one this model takes: {_suggest(name, types)}")
        datatype = tensor.get("datatype")
        if not isinstance(datatype, str):
            raise BadRequest(f'input {name!r}: "datatype" must be a string such as "INT32"')
        shape = tensor.get("shape")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise BadRequest(f'input {name!r}: "shape" must be a list of integers >= 0')
        parameters = tensor.get("parameters", {})
        if not isinstance(parameters, dict):
            raise BadRequest(f'input {name!r}: "parameters" must be an object')
        if "binary_data_size" in parameters or "shared_memory_region" in parameters:
            continue  # the values are not in the JSON
        if "data" not in tensor:
            raise BadRequest(f'input {name!r} has no "data"')
        _check_values(name, datatype, tensor["data"])
    _check_batch(inputs, next(iter(types)))
    for key, kind in (("outputs", list), ("parameters", dict), ("id", str)):
        if key in request and not isinstance(request[key], kind):
            raise BadRequest(f'"{key}" must be {_kind(kind())}')


def _check_batch(inputs: list[dict[str, Any]], rows: str) -> None:
    """Every input has a row per prompt, as the model's first input `rows` has (Triton's
    answer otherwise, "batch size does not match other inputs", says neither which prompts
    nor what to send)."""
    shapes = {tensor["name"]: tensor["shape"] for tensor in inputs}
    prompts = shapes.get(rows)
    if not prompts:
        return
    for name, shape in shapes.items():
        if shape and shape[0] != prompts[0]:
            raise BadRequest(
                f"input {name!r} has shape {shape} for {prompts[0]} prompt(s) ({rows} "
                f"shape {prompts}): give it one row per prompt (shape [{prompts[0]}, "
                f"{', '.join(str(d) for d in shape[1:]) or '1'}]), or leave it out for the "
                "model's default"
            )


def _check_generate(request: Any, path: str, types: Mapping[str, str]) -> None:
    if not isinstance(request, dict):
        raise BadRequest(
            f"the request body is {_kind(request)}; send a JSON object such as "
            f'{{"{TEXT_INPUT}": "Once upon a time", "tokens_to_generate": 16}}'
        )
    for name, value in request.items():
        if name in types:
            _check_values(name, types[name], value)
        elif name not in GENERATE_KEYS:
            raise BadRequest(f"unknown key {name!r}: {_suggest(name, types)}")
    prompts = request.get(TEXT_INPUT)
    if isinstance(prompts, list) and len(prompts) != 1:
        infer = re.sub(r"/generate(_stream)?$", "/infer", path)
        raise BadRequest(
            f"{TEXT_INPUT} is a list of {len(prompts)}: the generate endpoint takes one prompt "
            f"(a string) per request. To send several prompts, send a request each, or one "
            f"request to {infer} with {TEXT_INPUT} of shape [{len(prompts)}, 1] (the KServe v2 "
            "protocol, as tritonclient's infer sends it)"
        )


def _suggest(name: str, types: Mapping[str, str]) -> str:
    """Did-you-mean for an input name the model does not take, and the ones it does."""
    names = list(types)
    folded = name.lower().replace("-", "_")
    # Letters swapped first ("topk_" is top_k, though as near to top_p by difflib's measure).
    close = [known for known in names if sorted(known) == sorted(folded)]
    close = close or difflib.get_close_matches(folded, names, n=1, cutoff=0.6)
    known = f"the inputs are {', '.join(names)}"
    return f"did you mean {close[0]!r}? ({known})" if close else known


def _check_values(name: str, datatype: str, data: Any) -> None:
    for value in _flat(data):
        problem = _value_problem(datatype, value)
        if problem:
            raise BadRequest(f"input {name!r}: {json.dumps(value)[:60]} is not {problem}")


def _flat(data: Any) -> Iterator[Any]:
    if isinstance(data, list):
        for item in data:
            yield from _flat(item)
    else:
        yield data


def _value_problem(datatype: str, value: Any) -> str | None:
    """What a value of `datatype` must be, when `value` is not one; None when it is."""
    if datatype in INTEGER_RANGES:
        low, high = INTEGER_RANGES[datatype]
        if _is_int(value) and low <= value <= high:
            return None
        return f"{'a' if datatype[0] == 'U' else 'an'} {datatype} (an integer from {low} to {high})"
    if datatype in FLOATS:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return None if number and math.isfinite(value) else f"an {datatype} (a number)"
    if datatype == "BOOL":
        return None if isinstance(value, bool) else "a BOOL (true or false)"
    if datatype == "BYTES":
        return None if isinstance(value, str) else "BYTES (a string)"
    return None  # a datatype Triton itself will judge


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    return names.get(type(value), "a number" if isinstance(value, int | float) else "null")


def _is_parse_failure(status: int, body: bytes) -> bool:
    if status != 500:
        return False
    try:
        message = json.loads(body).get("error", "")
    except (ValueError, AttributeError):
        return False
    return isinstance(message, str) and message.startswith(PARSE_FAILURES)


class Front(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        port: int,
        backend_port: int,
        cancelled: Path | None = None,
        model_server: Path | None = None,
        models: tuple[str, ...] = (),
        inputs: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        """`cancelled`: the folder where a request whose client went away is marked (the
        model's CANCELLED_REQUESTS_VARIABLE); None: requests are not tagged. `model_server`:
        the model server's socket, which answers OpenAI's API (/v1/...) for `models`.
        `inputs`: each served model's inputs, which requests are checked against."""
        self.backend_port = backend_port
        self.cancelled = cancelled
        self.model_server, self.models = model_server, models
        self.inputs = dict(inputs or {})
        super().__init__(("", port), _Handler)
        self._thread = threading.Thread(target=self.serve_forever, name="http-front", daemon=True)

    def cancel(self, request_id: str) -> None:
        """Mark the request cancelled: its client is gone."""
        if self.cancelled is not None:
            (self.cancelled / request_id).touch()

    def cancel_all(self) -> None:
        """The server is stopping: the model drops every request it is working on."""
        if self.cancelled is not None:
            (self.cancelled / ALL_CANCELLED).touch()

    def forget(self, request_id: str) -> None:
        """The request's answer has come: the model no longer looks for its mark."""
        if self.cancelled is not None:
            (self.cancelled / request_id).unlink(missing_ok=True)

    def start(self) -> None:
        self._thread.start()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away mid-answer; the server goes on

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as clients of Triton expect
    server: Front

    def do_GET(self) -> None:
        if self.path.startswith("/v1/") and self.server.model_server is not None:
            self._openai()
        else:
            self._relay()

    do_POST = do_GET  # Triton's HTTP API has no other methods

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # Triton logs what it serves

    def _relay(self) -> None:
        try:
            body = self._body()
        except ValueError:  # a chunk size that is not hexadecimal
            self.close_connection = True  # where the next request would start is unknown
            self._reply(400, b'{"error":"the chunked request body is malformed"}')
            return
        if self.command == "POST":
            try:
                check_request(self.path, body, self.headers, self.server.inputs)
            except BadRequest as error:
                self._reply(400, json.dumps({"error": str(error)}).encode())
                return
        headers = {
            k: v
            for k, v in self.headers.items()
            if k.lower() not in HOP_BY_HOP and k.lower() != REQUEST_ID_HEADER
        }
        request_id, body = self._tag(headers, body)
        watch = None
        if request_id is not None:
            watch = HangupWatch(self.connection, partial(self.server.cancel, request_id))
        backend = http.client.HTTPConnection("127.0.0.1", self.server.backend_port)
        try:
            try:
                backend.request(self.command, self.path, body=body or None, headers=headers)
                response = backend.getresponse()
            except OSError:
                self._reply(503, b'{"error":"the Triton server is not accepting requests now"}')
                return
            try:
                self._pass_on(response)
            except OSError:  # the client went away mid-answer (a stream): drop the rest
                if request_id is not None:
                    self.server.cancel(request_id)
                    while response.read1(65536):
                        pass  # until the model has stopped
                raise
        finally:
            backend.close()
            if watch is not None:
                watch.stop()
                self.server.forget(request_id)

    def _openai(self) -> None:
        """OpenAI's API (openai_api.py), answered from the model server."""
        from launcher_scripts.jobs.export import openai_api as api

        path = self.path.split("?", 1)[0].rstrip("/")
        kinds = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
        try:
            body = self._body()
            if path == "/v1/models" and self.command == "GET":
                self._reply(200, json.dumps(api.models(list(self.server.models))).encode())
                return
            if path not in kinds or self.command != "POST":
                raise api.ApiError(f"{self.command} {path} is not part of this API", status=404)
            kind = kinds[path]
            try:
                request = json.loads(body or b"null")
            except ValueError as error:
                raise api.ApiError(f"the request body is not JSON: {error}") from None
            model = request.get("model") if isinstance(request, dict) else None
            served = self.server.models[0] if self.server.models else "model"
            if model is not None and model not in self.server.models:
                known = ", ".join(self.server.models)
                raise api.ApiError(f"model {model!r} is not served here: {known}", "model", 404)
            message, stream = api.model_server_request(kind, request)
        except api.ApiError as error:
            self._reply(error.status, error.body())
            return
        except ValueError:  # a malformed chunked body
            self.close_connection = True
            self._reply(400, b'{"error":{"message":"the chunked request body is malformed"}}')
            return
        # Closing the answer's lines (a client gone mid-stream raises while they are read)
        # closes the connection to the model server, which then frees the request's slots.
        with contextlib.closing(answer_lines(self.server.model_server, message)) as lines:
            if not stream:
                try:
                    answer = next(lines)
                except OSError as error:  # the model server went away
                    answer = {"error": str(error), "status": 500}
                if "error" in answer:
                    error = api.api_error(answer)
                    self._reply(error.status, error.body())
                else:
                    self._reply(200, json.dumps(api.response(kind, served, answer)).encode())
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for event in api.stream_events(kind, served, lines):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    def _tag(self, headers: dict[str, str], body: bytes) -> tuple[str | None, bytes]:
        """An inference request's id (None for other requests), and the body to send on.

        Triton passes the id to the model as a request parameter: from the header for an
        infer request (--http-header-forward-pattern), from the body's "parameters" object
        for a generate request (whose handler forwards no header)."""
        path = self.path.split("?", 1)[0]
        if self.command != "POST" or self.server.cancelled is None:
            return None, body
        request_id = uuid.uuid4().hex
        if INFER.match(path):
            headers[REQUEST_ID_HEADER] = request_id
            return request_id, body
        if not GENERATE.match(path) or self.headers.get("Content-Encoding"):
            return None, body
        request = json.loads(body)  # check_request parsed it: an object
        parameters = request.get("parameters")
        request["parameters"] = {
            **(parameters if isinstance(parameters, dict) else {}),
            REQUEST_ID_HEADER: request_id,
        }
        return request_id, json.dumps(request).encode()

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            return b"".join(self._chunks())
        length = self.headers.get("Content-Length")
        return self.rfile.read(int(length)) if length and length.isdigit() else b""

    def _chunks(self) -> Iterator[bytes]:
        while True:
            size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return
            yield self.rfile.read(size)
            self.rfile.readline()

    def _pass_on(self, response: http.client.HTTPResponse) -> None:
        headers = [(k, v) for k, v in response.getheaders() if k.lower() not in HOP_BY_HOP]
        if not response.chunked:
            data = response.read()
            status = 400 if _is_parse_failure(response.status, data) else response.status
            self._reply(status, data, headers)
            return
        self.send_response(response.status)
        for key, value in headers:
            self.send_header(key, value)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        while piece := response.read1(65536):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _reply(
        self, status: int, data: bytes, headers: list[tuple[str, str]] | None = None
    ) -> None:
        self.send_response(status)
        for key, value in headers or [("Content-Type", "application/json")]:
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
