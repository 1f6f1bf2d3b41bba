"""OpenAI's HTTP API on the serving front: what clients, evaluation harnesses and RL tools speak.

    GET  /v1/models                 the served model
    POST /v1/completions            prompt (a string or a list), max_tokens, temperature, top_p,
                                    stop, seed, stream
    POST /v1/chat/completions       messages (system, user, assistant), the same parameters

The front answers these itself from the model server (jobs/inference/model_server.py), the way
Triton's models do: one in-flight batch for every client. Streams are server-sent events
(`data: {chunk}` ... `data: [DONE]`). A chat's prompt is the model's chat format, the one the
launcher's fine-tuning trains on (NeMo's): the system text, then a line per turn,
"\\nUser: ..." and "\\nAssistant: ...", ending with "\\nAssistant: " for the answer, which stops
before the next "\\nUser:". Bad input is a 400 with OpenAI's error object, naming the field.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

CHAT_ROLES = {"user": "User", "assistant": "Assistant"}
NEXT_TURN = "\nUser:"
DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default
FINISH = {"eod": "stop", "stop": "stop", "length": "length"}
KNOWN = {
    "completions": {"model", "prompt", "max_tokens", "temperature", "top_p", "stop", "seed",
                    "stream", "n", "user", "echo", "logprobs", "frequency_penalty",
                    "presence_penalty"},
    "chat": {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
             "stop", "seed", "stream", "n", "user", "frequency_penalty", "presence_penalty"},
}  # fmt: skip


class ApiError(ValueError):
    """A request the API refuses: (status, message naming the field)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status

    def body(self) -> bytes:
        error = {"message": str(self), "type": "invalid_request_error", "param": self.param}
        return json.dumps({"error": error}).encode()


def chat_prompt(messages: Any) -> str:
    """The model's chat format of OpenAI's messages (see the module's docstring)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages: give a non-empty list of {role, content} objects", "messages")
    system, turns = "", []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ApiError(f"{where}: give an object with role and content", "messages")
        role, content = message.get("role"), message.get("content")
        if isinstance(content, list):  # content parts: the text ones
            content = "".join(
                str(part.get("text", "")) for part in content if isinstance(part, dict)
            )
        if not isinstance(content, str):
            raise ApiError(f"{where}.content: give a string", "messages")
        if role in ("system", "developer"):
            system += content
        elif role in CHAT_ROLES:
            turns.append(f"\n{CHAT_ROLES[role]}: {content}")
        else:
            known = ", ".join(["system", *CHAT_ROLES])
            raise ApiError(f"{where}.role: {role!r} is not one of {known}", "messages")
    if not turns:
        raise ApiError("messages: give at least one user message", "messages")
    return system + "".join(turns) + f"\n{CHAT_ROLES['assistant']}: "


def model_server_request(kind: str, body: Any) -> tuple[dict[str, Any], bool]:
    """The model server's request for an API request of `kind` (completions | chat), and
    whether it streams."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    unknown = sorted(set(body) - KNOWN[kind])
    if unknown:
        raise ApiError(f"{unknown[0]} is not a parameter this server takes", unknown[0])
    if kind == "chat":
        prompts = [chat_prompt(body.get("messages"))]
    else:
        prompt = body.get("prompt")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if (
            not isinstance(prompts, list)
            or not prompts
            or not all(isinstance(p, str) and p for p in prompts)
        ):
            raise ApiError("prompt: give a non-empty string, or a list of them", "prompt")
    for name, allowed in (("n", (None, 1)), ("echo", (None, False)), ("logprobs", (None,))):
        if body.get(name) not in allowed:
            raise ApiError(f"{name}: {body[name]!r} is not supported here; leave it out", name)
    tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    params: dict[str, Any] = {
        "tokens_to_generate": DEFAULT_MAX_TOKENS if tokens is None else tokens,
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "top_k": 0,
    }
    if params["temperature"] == 0:  # OpenAI's greedy
        params.update(temperature=1.0, top_k=1)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if kind == "chat":
        stops.append(NEXT_TURN)
    params["stop_words"] = stops
    if body.get("seed") is not None:
        params["random_seed"] = body["seed"]
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError("stream: give true or false", "stream")
    if stream and len(prompts) != 1:
        raise ApiError("stream: one prompt per streamed request", "prompt")
    return {"prompts": prompts, "params": params, "stream": stream}, stream


def api_error(answer: dict[str, Any]) -> ApiError:
    """The model server's refusal, with the API's names for its parameters."""
    message = str(answer.get("error", "the model server failed"))
    for ours, theirs in (("tokens_to_generate", "max_tokens"), ("stop_words", "stop")):
        message = message.replace(ours, theirs)
    message = message.replace("params.", "")
    return ApiError(message, status=int(answer.get("status", 500)))


def _ids(kind: str) -> tuple[str, str, int]:
    prefix, obj = ("chatcmpl", "chat.completion") if kind == "chat" else ("cmpl", "text_completion")
    return f"{prefix}-{uuid.uuid4().hex[:24]}", obj, int(time.time())


def response(kind: str, model: str, answer: dict[str, Any]) -> dict[str, Any]:
    """The API's answer object from the model server's answer."""
    ident, obj, created = _ids(kind)
    choices = []
    pairs = zip(answer["texts"], answer["finish_reasons"], strict=True)
    for index, (text, reason) in enumerate(pairs):
        choice: dict[str, Any] = {"index": index, "finish_reason": FINISH.get(reason, reason)}
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        choices.append(choice)
    prompt_tokens = sum(answer.get("prompt_tokens", []))
    completion_tokens = sum(answer.get("completion_tokens", []))
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    return {"id": ident, "object": obj, "created": created, "model": model, "choices": choices,
            "usage": usage}  # fmt: skip


def stream_events(kind: str, model: str, lines: Iterator[dict[str, Any]]) -> Iterator[bytes]:
    """Server-sent events from the model server's stream lines."""
    ident, obj, created = _ids(kind)
    obj += ".chunk" if kind == "chat" else ""

    def event(delta: str | None, finish: str | None) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if kind == "chat":
            choice["delta"] = {} if delta is None else {"role": "assistant", "content": delta}
        else:
            choice.update(text=delta or "", logprobs=None)
        chunk = {"id": ident, "object": obj, "created": created, "model": model,
                 "choices": [choice]}  # fmt: skip
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    for line in lines:
        if "text" in line:
            yield event(line["text"], None)
        elif "error" in line:
            error = api_error(line)
            yield b"data: " + error.body() + b"\n\n"
            break
        else:
            yield event(None, FINISH.get(line.get("finish_reason"), "stop"))
            break
    yield b"data: [DONE]\n\n"


def models(names: list[str]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "llm-launcher"}
            for name in names
        ],  # fmt: skip
    }
