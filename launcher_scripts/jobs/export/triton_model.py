"""The model Triton's Python backend runs: each exported repository's `model.py` is a two-line
file that imports `TritonPythonModel` from here.

Requests are checked one by one (a bad one gets its own INVALID_ARG error, HTTP 400, and the
others are served); rows that ask for the same generation parameters are decoded together, in as
few batches as the memory free for a request allows. A request whose generation alone would not
fit (many beams, say) is refused before anything is allocated: the process that serves the
valid requests must not be the one the kernel kills. A request that asks for more generated
tokens (prompts x beams x tokens_to_generate) than the export's `max_request_tokens` is refused
too: it would hold the model, and every client waiting, for minutes. A request whose client went
away (http_front.py marks it; a gRPC client cancels it) stops at the next generation step.
The streaming twin (a decoupled model) sends the text as it is generated, one response per
piece, then an empty final one.
"""

from __future__ import annotations

import json
import locale
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from launcher_scripts.recipes.triton_interface import (
    ALL_CANCELLED,
    CANCELLED_REQUESTS_VARIABLE,
    FINISH_REASON,
    MAX_REQUEST_TOKENS,
    PARAMETERS,
    REQUEST_ID_HEADER,
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


class Cancelled(Exception):
    """Every request of a generation was cancelled: stop generating."""

    def __init__(self, steps: int) -> None:
        super().__init__(f"cancelled after {steps} generation steps")
        self.steps = steps


CANCELLED_MESSAGE = "cancelled: the client went away or the server is stopping"


@dataclass
class Row:
    """One prompt of a request and the parameters it asked for."""

    request: Any  # its index in the request; (request number, index) once batched
    prompt: str
    params: Any  # GenerationParams
    tokens: int  # the prompt's


def parse_request(read: Any, defaults: Any, served: Any) -> list[Row]:
    """The rows of one request to `served` (a served.ServedModel). `read(name)` returns the
    input as a numpy array or None.

    Raises RequestError for anything the client must change.
    """
    texts = read(TEXT_INPUT)
    if texts is None:
        raise RequestError(f"the input {TEXT_INPUT} is required: send the prompt text (BYTES)")
    prompts = [_text(value) for value in np.asarray(texts).reshape(len(texts), -1)[:, 0]]
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
            raise RequestError(f"{TEXT_INPUT} is empty: send a prompt of at least one token")
        prompt_tokens = len(served.tokenizer.encode(prompt))
        problem = served.too_long(prompt_tokens, params.tokens_to_generate)
        if problem:
            raise RequestError(problem)
        rows.append(Row(index, prompt, params, prompt_tokens))
    return rows


def too_large(shape: Any, budget: Any, group: Sequence[Row]) -> str | None:
    """Why generating these rows (equal parameters) in one batch does not fit the memory a
    request may use (memory.py), or None."""
    from launcher_scripts.jobs.inference.generation import peak_batch
    from launcher_scripts.jobs.inference.memory import too_large as exceeds

    params = group[0].params
    _rows, width = peak_batch([row.tokens for row in group], params)
    return exceeds(shape, budget, len(group), params.beam_width, width)


def too_many_tokens(rows: Sequence[Row], limit: int | None) -> str | None:
    """Why a request's rows ask for more generation than one request may (the export's
    max_request_tokens), or None. Generation's time grows with every beam's every token: a
    request over the limit would hold the model for minutes."""
    total = sum(row.params.beam_width * row.params.tokens_to_generate for row in rows)
    if limit is None or total <= limit:
        return None
    beams = max(row.params.beam_width for row in rows)
    tokens = max(row.params.tokens_to_generate for row in rows)
    prompts = len(rows)
    if beams > 1 and limit // (prompts * tokens) >= 1:
        advice = f"lower beam_width to at most {limit // (prompts * tokens)}"
    elif limit // (prompts * beams) >= 1:
        advice = f"lower tokens_to_generate to at most {limit // (prompts * beams)}"
    else:
        advice = "send fewer prompts per request"
    return (
        f"the request asks for {total} generated tokens ({prompts} prompt(s) x beam_width "
        f"{beams} x tokens_to_generate {tokens}), more than the {limit} one request may ask "
        f"for on this server (the export's triton_deployment.{MAX_REQUEST_TOKENS}): {advice}"
    )


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


def stoppable(decoding: Any, cancelled: Callable[[], bool]) -> Any:
    """`decoding` whose caches raise Cancelled instead of running a step once `cancelled()`:
    generation takes one step per token, so a cancelled generation ends within one step."""
    return _Stoppable(decoding, cancelled)


class _Stoppable:
    def __init__(self, decoding: Any, cancelled: Callable[[], bool]) -> None:
        self.decoding, self.cancelled, self.steps = decoding, cancelled, 0

    def cache(self, slots: int, positions: int) -> Any:
        return _StoppableCache(self, self.decoding.cache(slots, positions))

    def check(self) -> None:
        if self.cancelled():
            raise Cancelled(self.steps)
        self.steps += 1


class _StoppableCache:
    def __init__(self, owner: _Stoppable, cache: Any) -> None:
        self.owner, self.inner = owner, cache

    def add(self, prompts: Any) -> Any:
        self.owner.check()
        return self.inner.add(prompts)

    def step(self, sequences: Any, tokens: Any) -> Any:
        self.owner.check()
        return self.inner.step(sequences, tokens)

    def fork(self, sequence: int) -> int:
        return self.inner.fork(sequence)

    def drop(self, sequence: int) -> None:
        self.inner.drop(sequence)


def request_id_of(parameters_json: str) -> str | None:
    """The front's id among a request's parameters (Triton's JSON of them)."""
    try:
        value = json.loads(parameters_json or "{}").get(REQUEST_ID_HEADER)
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value.isalnum() else None


def fitting_batches(shape: Any, budget: Any, group: Sequence[Row]) -> list[list[Row]]:
    """`group` cut, in order, into batches that each fit. Each request was checked on its own,
    so every row fits alone; the dynamic batcher may have gathered more than fit together."""
    batches: list[list[Row]] = []
    for row in group:
        if batches and too_large(shape, budget, [*batches[-1], row]) is None:
            batches[-1].append(row)
        else:
            batches.append([row])
    return batches


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def _convert(parameter: Any, value: np.ndarray) -> Any:
    if parameter.many:
        return tuple(word for word in (_text(v) for v in value.reshape(-1)) if word)
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
    from launcher_scripts.jobs.inference.generation import GenerationParams

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
        from launcher_scripts.jobs.inference.served import open_served

        config = json.loads(args["model_config"])
        parameters = config.get("parameters", {})
        model_dir = Path(args["model_repository"])
        model_file = (model_dir / parameters["model_file"]["string_value"]).resolve()
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.defaults = defaults_from(parameters)
        self.model = open_served(model_file)
        self.shape = self.model.shape
        limit = parameters.get(MAX_REQUEST_TOKENS, {}).get("string_value")
        self.max_request_tokens = None if limit is None else int(limit)
        self.name = args["model_name"]
        print(f"{self.name}: serving {model_file} (decoupled={self.decoupled})", flush=True)

    def execute(self, requests: list[Any]) -> list[Any] | None:
        if self.decoupled:
            for request in requests:
                self._stream(request)
            return None
        return self._batch(requests)

    def _rows(self, request: Any, budget: Any) -> list[Row]:
        def read(name: str) -> np.ndarray | None:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        rows = parse_request(read, self.defaults, self.model)
        for group in group_rows(rows):
            problem = too_large(self.shape, budget, group)
            if problem:
                raise RequestError(problem)
        problem = too_many_tokens(rows, self.max_request_tokens)
        if problem:
            raise RequestError(problem)
        return rows

    def _cancellation(self, request: Any) -> tuple[str | None, Callable[[], bool]]:
        request_id = request_id_of(request.parameters())
        is_cancelled = getattr(request, "is_cancelled", None)
        client = (lambda: bool(is_cancelled())) if is_cancelled else (lambda: False)
        return request_id, cancellation(request_id, client)

    def _say_cancelled(self, request_ids: Sequence[str | None], stop: Cancelled) -> None:
        named = ", ".join(str(request_id) for request_id in request_ids)
        print(
            f"{self.name}: cancelled request(s) {named} after {stop.steps} generation steps: "
            "the client went away or the server is stopping",
            flush=True,
        )

    def _batch(self, requests: list[Any]) -> list[Any]:
        from launcher_scripts.jobs.inference.generation import generate
        from launcher_scripts.jobs.inference.memory import budget_now

        budget = budget_now(self.model.on_gpu)
        results: list[dict[int, Any]] = [{} for _ in requests]
        errors: dict[int, str] = {}
        rows: list[Row] = []
        watched = [self._cancellation(request) for request in requests]
        cancelled: set[int] = set()
        for number, request in enumerate(requests):
            try:
                rows += [
                    replace(row, request=(number, row.request))
                    for row in self._rows(request, budget)
                ]
            except RequestError as error:
                errors[number] = str(error)
        batches = [
            batch
            for group in group_rows(rows)
            for batch in fitting_batches(self.shape, budget, group)
        ]
        for group in batches:
            numbers = sorted({row.request[0] for row in group})
            checks = [watched[number][1] for number in numbers]
            try:
                completions = generate(
                    stoppable(self.model.decoding, lambda checks=checks: all(c() for c in checks)),
                    self.model.tokenizer,
                    [row.prompt for row in group],
                    group[0].params,
                    max_length=self.model.max_length,
                )
            except ValueError as error:
                for row in group:
                    errors[row.request[0]] = str(error)
                continue
            except Cancelled as stop:
                self._say_cancelled([watched[number][0] for number in numbers], stop)
                cancelled.update(numbers)
                continue
            for row, completion in zip(group, completions, strict=True):
                number, index = row.request
                results[number][index] = completion
        return [
            _error_response(CANCELLED_MESSAGE, "CANCELLED")
            if number in cancelled
            else _error_response(errors[number])
            if number in errors
            else _response(
                [results[number][i].text for i in sorted(results[number])],
                [results[number][i].finish_reason for i in sorted(results[number])],
            )
            for number in range(len(requests))
        ]

    def _stream(self, request: Any) -> None:
        from launcher_scripts.jobs.inference.generation import stream
        from launcher_scripts.jobs.inference.memory import budget_now

        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            rows = self._rows(request, budget_now(self.model.on_gpu))
            if len(rows) != 1:
                raise RequestError("the streaming model takes one prompt per request")
            row = rows[0]
            if row.params.beam_width != 1:
                raise RequestError("streaming needs beam_width 1: use the non-streaming model")
            request_id, cancelled = self._cancellation(request)
            pieces = stream(
                stoppable(self.model.decoding, cancelled),
                self.model.tokenizer,
                row.prompt,
                row.params,
                max_length=self.model.max_length,
            )
            for piece in pieces:
                sender.send(_response([piece], [""]))
        except ValueError as error:  # RequestError included
            sender.send(_error_response(str(error)), flags=final)
            return
        except Cancelled as stop:
            self._say_cancelled([request_id], stop)
            sender.send(_error_response(CANCELLED_MESSAGE, "CANCELLED"), flags=final)
            return
        sender.send(flags=final)

    def finalize(self) -> None:
        from launcher_scripts.jobs.inference.runner import close_runner

        close_runner()


def _response(texts: list[str], reasons: list[str]) -> Any:
    as_bytes = [[text.encode("utf-8")] for text in texts]
    return pb_utils.InferenceResponse(
        output_tensors=[
            pb_utils.Tensor(TEXT_OUTPUT, np.array(as_bytes, dtype=object)),
            pb_utils.Tensor(FINISH_REASON, np.array([[r.encode()] for r in reasons], dtype=object)),
        ]
    )


def _error_response(message: str, kind: str = "INVALID_ARG") -> Any:
    code = getattr(pb_utils.TritonError, kind, None)
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)
