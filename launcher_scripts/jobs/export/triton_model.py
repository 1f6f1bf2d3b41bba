"""The model Triton's Python backend runs: each exported repository's `model.py` is a two-line
file that imports `TritonPythonModel` from here.

It is a thin client: the model itself runs in the model server (jobs/inference/model_server.py,
started by `serve` beside Triton: the model's ranks at its TP/PP, one in-flight batch for every
request of both models). Each request is checked here (a bad one gets its own INVALID_ARG
error, HTTP 400, and the others are served), its rows with equal parameters go to the server
as one request, and the answers come back as they are done: a request arriving while others
generate joins their batch at the next step (the model server refuses what its slots or the
export's `max_request_tokens` do not allow). A request whose client
went away (http_front.py marks it; a gRPC client cancels it) is dropped at once: its
connection to the model server closes, which frees its slots at the next step.
The streaming twin (a decoupled model) sends the text as it is generated, one response per
piece, then an empty final one. The model on ids (the ensemble's middle step) takes prompts as
token ids and returns the generated ids, padded after each row's length.
"""

from __future__ import annotations

import json
import locale
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from launcher_scripts.jobs.inference.model_server import Withdrawn, answer_lines
from launcher_scripts.recipes.generation_params import GenerationParams
from launcher_scripts.recipes.triton_interface import (
    ALL_CANCELLED,
    CANCELLED_REQUESTS_VARIABLE,
    FINISH_REASON,
    INPUT_IDS,
    INPUT_LENGTHS,
    MODEL_SERVER_VARIABLE,
    OUTPUT_IDS,
    PAD_ID,
    PARAMETERS,
    REQUEST_ID_HEADER,
    SEQUENCE_LENGTH,
    TEXT_INPUT,
    TEXT_OUTPUT,
)


def _utf8_locale() -> None:
    """Triton's stub embeds Python without setting the locale, so files opened as text (torch
    reads its templates so) decode as ASCII there. Ask for UTF-8 before torch is imported."""
    if locale.getpreferredencoding(False).lower().replace("-", "") == "utf8":
        return
    for name in ("C.UTF-8", "C.utf8", "en_US.UTF-8", ""):
        try:
            locale.setlocale(locale.LC_CTYPE, name)
            return
        except locale.Error:
            continue


_utf8_locale()

try:  # present only inside Triton's Python backend
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported by tests and tools outside the server
    pb_utils = None


class RequestError(ValueError):
    """A request the model cannot serve, with the message the client sees."""


CANCELLED_MESSAGE = "cancelled: the client went away or the server is stopping"


@dataclass
class Row:
    """One prompt of a request and the parameters it asked for."""

    request: Any  # its index in the request
    prompt: str | list[int]
    params: GenerationParams


def _prompts(read: Any, on_ids: bool) -> list[str] | list[list[int]]:
    if not on_ids:
        texts = read(TEXT_INPUT)
        if texts is None:
            raise RequestError(f"the input {TEXT_INPUT} is required: send the prompt text (BYTES)")
        return [as_text(value) for value in np.asarray(texts).reshape(len(texts), -1)[:, 0]]
    ids = read(INPUT_IDS)
    if ids is None:
        raise RequestError(f"the input {INPUT_IDS} is required: send the prompt's token ids")
    lengths = read(INPUT_LENGTHS)
    if lengths is None:
        return [[int(token) for token in row] for row in np.asarray(ids).reshape(len(ids), -1)]
    return cut_rows(ids, lengths, INPUT_LENGTHS, least=1)


def cut_rows(ids: Any, lengths: Any, lengths_name: str, least: int) -> list[list[int]]:
    """Each row of a padded [rows, width] id array cut to its length (`lengths_name`'s value
    for the row, at least `least`); RequestError naming a length that does not fit."""
    ids = np.asarray(ids).reshape(len(ids), -1)
    lengths = np.asarray(lengths).reshape(-1)
    if lengths.size != len(ids):
        raise RequestError(f"{lengths_name} has {lengths.size} values for {len(ids)} rows of ids")
    rows = []
    for row, length in zip(ids, lengths, strict=True):
        if not least <= length <= len(row):
            raise RequestError(
                f"{lengths_name} {int(length)} is not within the row's {len(row)} ids: give "
                f"each row's count of ids (at least {least})"
            )
        rows.append([int(token) for token in row[: int(length)]])
    return rows


def parse_request(read: Any, defaults: Any, on_ids: bool = False) -> list[Row]:
    """The rows of one request. `read(name)` returns the input as a numpy array or None;
    `on_ids`: prompts come as token ids (input_ids, input_lengths), not text.

    Raises RequestError for anything the client must change (the model server checks the
    prompts' lengths against the model's positions and ids against its vocabulary).
    """
    prompts = _prompts(read, on_ids)
    rows = []
    for index, prompt in enumerate(prompts):
        changes: dict[str, Any] = {}
        for parameter in PARAMETERS:
            value = read(parameter.name)
            if value is None:
                continue
            value = np.asarray(value)
            row = value[index] if value.shape and value.shape[0] == len(prompts) else value
            changes[parameter.name] = _convert(parameter, np.asarray(row))
        params = replace(defaults, **changes)
        try:
            params.check()
        except ValueError as error:
            raise RequestError(str(error)) from None
        if not prompt:
            empty = INPUT_IDS if on_ids else TEXT_INPUT
            raise RequestError(f"{empty} is empty: send a prompt of at least one token")
        rows.append(Row(index, prompt, params))
    return rows


def cancellation(
    request_id: str | None, client_cancelled: Callable[[], bool]
) -> Callable[[], bool]:
    """Whether a request is cancelled now: marked by the HTTP front (its client went away, or
    the server is stopping), or cancelled by its gRPC client."""
    folder = os.environ.get(CANCELLED_REQUESTS_VARIABLE)
    marks = [] if not folder else [Path(folder) / ALL_CANCELLED]
    if folder and request_id:
        marks.append(Path(folder) / request_id)

    def cancelled() -> bool:
        return any(mark.exists() for mark in marks) or client_cancelled()

    return cancelled


def request_id_of(parameters_json: str) -> str | None:
    """The front's id among a request's parameters (Triton's JSON of them)."""
    try:
        value = json.loads(parameters_json or "{}").get(REQUEST_ID_HEADER)
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value.isalnum() else None


def as_text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def _convert(parameter: Any, value: np.ndarray) -> Any:
    if parameter.many:
        return tuple(word for word in (as_text(v) for v in value.reshape(-1)) if word)
    if value.size != 1:
        raise RequestError(f"{parameter.name} takes one value per prompt, got {value.size}")
    item = value.reshape(-1)[0]
    return item.item() if hasattr(item, "item") else item


def group_rows(rows: Sequence[Row]) -> list[list[Row]]:
    """Rows with equal parameters, in first-seen order: each group is one generation batch."""
    groups: dict[Any, list[Row]] = {}
    for row in rows:
        groups.setdefault(row.params, []).append(row)
    return list(groups.values())


def defaults_from(config_parameters: dict[str, Any]) -> Any:
    """GenerationParams from the `default_<name>` parameters the export wrote."""
    values: dict[str, Any] = {}
    kinds = {field.name: field for field in fields(GenerationParams)}
    for parameter in PARAMETERS:
        raw = config_parameters.get(f"default_{parameter.name}", {}).get("string_value")
        if raw is None or parameter.name not in kinds:
            continue
        values[parameter.name] = json.loads(raw)
        if parameter.many:
            values[parameter.name] = tuple(values[parameter.name])
    params = GenerationParams(**values)
    params.check()
    return params


class TritonPythonModel:
    """Triton's entry points: initialize, execute, finalize."""

    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        parameters = config.get("parameters", {})
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.on_ids = any(tensor["name"] == INPUT_IDS for tensor in config.get("input", []))
        self.defaults = defaults_from(parameters)
        self.name = args["model_name"]
        self.server = os.environ.get(MODEL_SERVER_VARIABLE)
        if not self.server:
            raise RuntimeError(
                f"{self.name}: {MODEL_SERVER_VARIABLE} is not set: start the server with "
                "`python3 -m launcher_scripts serve EXPORT_DIR`, which starts the model server"
            )
        self.threads: list[threading.Thread] = []
        print(f"{self.name}: answering from the model server at {self.server}", flush=True)

    def execute(self, requests: list[Any]) -> list[Any] | None:
        if self.decoupled:
            for request in requests:  # answered from threads: execute returns at once
                thread = threading.Thread(target=self._stream, args=(request,), daemon=True)
                thread.start()
                self.threads = [t for t in self.threads if t.is_alive()] + [thread]
            return None
        return self._batch(requests)

    def _rows(self, request: Any) -> list[Row]:
        def read(name: str) -> np.ndarray | None:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        return parse_request(read, self.defaults, self.on_ids)

    def _cancellation(self, request: Any) -> tuple[str | None, Callable[[], bool]]:
        request_id = request_id_of(request.parameters())
        is_cancelled = getattr(request, "is_cancelled", None)
        client = (lambda: bool(is_cancelled())) if is_cancelled else (lambda: False)
        return request_id, cancellation(request_id, client)

    def _say_cancelled(self, request_ids: Sequence[str | None]) -> None:
        named = ", ".join(str(request_id) for request_id in request_ids)
        print(
            f"{self.name}: cancelled request(s) {named}: the client went away or the server is "
            "stopping; the model server freed their slots",
            flush=True,
        )

    def _batch(self, requests: list[Any]) -> list[Any]:
        """Every request's groups of rows (equal parameters) asked of the model server at once,
        each on its own connection: the server batches them with whatever else is running."""
        asks: list[tuple[int, list[Row]]] = []
        errors: dict[int, str] = {}
        watched = [self._cancellation(request) for request in requests]
        for number, request in enumerate(requests):
            try:
                asks += [(number, group) for group in group_rows(self._rows(request))]
            except RequestError as error:
                errors[number] = str(error)
        results: list[dict[int, tuple[str, list[int], str]]] = [{} for _ in requests]
        cancelled: set[int] = set()

        def ask_group(number: int, group: list[Row]) -> None:
            message = {"prompts": [row.prompt for row in group], "params": _params(group[0])}
            try:
                answer = list(answer_lines(self.server, message, watched[number][1]))[-1]
            except Withdrawn:
                cancelled.add(number)
                return
            except OSError as error:  # the model server went away (ConnectionError)
                errors[number] = str(error)
                return
            if "error" in answer:
                errors[number] = answer["error"]
                return
            answers = zip(answer["texts"], answer["tokens"], answer["finish_reasons"], strict=True)
            for row, row_answer in zip(group, answers, strict=True):
                results[number][row.request] = row_answer

        threads = [threading.Thread(target=ask_group, args=ask) for ask in asks]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if cancelled:
            self._say_cancelled([watched[number][0] for number in sorted(cancelled)])
        responses = []
        for number in range(len(requests)):
            if number in cancelled:
                responses.append(error_response(CANCELLED_MESSAGE, "CANCELLED"))
            elif number in errors:
                responses.append(error_response(errors[number]))
            else:
                texts, tokens, reasons = zip(
                    *(results[number][index] for index in sorted(results[number])), strict=True
                )
                if self.on_ids:
                    responses.append(_ids_response(list(tokens), list(reasons)))
                else:
                    responses.append(_response(list(texts), list(reasons)))
        return responses

    def _stream(self, request: Any) -> None:
        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            rows = self._rows(request)
            if len(rows) != 1:
                raise RequestError("the streaming model takes one prompt per request")
            row = rows[0]
            if row.params.beam_width != 1:
                raise RequestError("streaming needs beam_width 1: use the non-streaming model")
            request_id, cancelled = self._cancellation(request)
            message = {"prompts": [row.prompt], "params": _params(row), "stream": True}

            for line in answer_lines(self.server, message, cancelled):
                if "text" in line:
                    sender.send(_response([line["text"]], [""]))
                elif "error" in line:
                    raise RequestError(line["error"])
        except (RequestError, OSError) as error:  # OSError: the model server went away
            sender.send(error_response(str(error)), flags=final)
            return
        except Withdrawn:
            self._say_cancelled([request_id])
            sender.send(error_response(CANCELLED_MESSAGE, "CANCELLED"), flags=final)
            return
        sender.send(flags=final)

    def finalize(self) -> None:
        for thread in self.threads:
            thread.join(timeout=10)


def _params(row: Row) -> dict[str, Any]:
    """A row's parameters as the model server reads them (JSON)."""
    values = {field.name: getattr(row.params, field.name) for field in fields(row.params)}
    values["stop_words"] = list(values["stop_words"])
    return values


def _response(texts: list[str], reasons: list[str]) -> Any:
    as_bytes = [[text.encode("utf-8")] for text in texts]
    return pb_utils.InferenceResponse(
        output_tensors=[
            pb_utils.Tensor(TEXT_OUTPUT, np.array(as_bytes, dtype=object)),
            pb_utils.Tensor(FINISH_REASON, np.array([[r.encode()] for r in reasons], dtype=object)),
        ]
    )


def padded_ids(rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ids as one [rows, longest] INT32 array padded with PAD_ID, and their lengths."""
    lengths = np.array([[len(row)] for row in rows], dtype=np.int32)
    ids = np.full((len(rows), max(1, int(lengths.max(initial=0)))), PAD_ID, dtype=np.int32)
    for index, row in enumerate(rows):
        ids[index, : len(row)] = row
    return ids, lengths


def _ids_response(tokens: list[list[int]], reasons: list[str]) -> Any:
    ids, lengths = padded_ids(tokens)
    return pb_utils.InferenceResponse(
        output_tensors=[
            pb_utils.Tensor(OUTPUT_IDS, ids),
            pb_utils.Tensor(SEQUENCE_LENGTH, lengths),
            pb_utils.Tensor(FINISH_REASON, np.array([[r.encode()] for r in reasons], dtype=object)),
        ]
    )


def error_response(message: str, kind: str = "INVALID_ARG") -> Any:
    code = getattr(pb_utils.TritonError, kind, None)
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)
