"""A model's ranks as one server: in-flight batching behind a local socket, at any TP/PP.

    python -m launcher_scripts.jobs.inference.model_server --model FILE.nemo --socket PATH
        [--tensor 1] [--pipeline 1] [--slots 16] [--cpu]

Started as TP x PP processes (torchrun, srun, or one process alone). Rank 0 listens on a Unix
socket and schedules every request into one EngineLoop; the other ranks repeat its cache calls
(broadcast_cache.py). A front (Triton's Python model, a benchmark, a test) connects, sends one
JSON line and reads JSON lines back:

    request:  {"prompts": ["...", or [token ids]], "params": {GenerationParams' fields},
               "stream": false}
    answer:   {"texts": [...], "tokens": [[generated ids]], "finish_reasons": [...],
               "prompt_tokens": [...], "completion_tokens": [...]}
    stream:   {"text": "piece"} ... then {"finish_reason": "...", "done": true}
    error:    {"error": "one line naming the problem", "status": 400}
    stats:    {"stats": true} -> {"live": sequences in the cache, "steps": cache steps so far}
    tokenize: {"tokenize": ["..."]} -> {"ids": [[...]]}
    detokenize: {"detokenize": [[generated ids]], "after": [[prompt ids]]} -> {"texts": [...]}

The tokenizer requests serve Triton's `preprocessing` and `postprocessing` models (the
ensemble): the tokenizer lives with the model, so Triton's Python needs none of its packages.

A client that closes its connection before its answer has its request cancelled: its slots are
free at the next step. The socket path is written once the model is loaded and listening.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import os
import queue
import select
import signal
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

from launcher_scripts.jobs.hangup import HangupWatch
from launcher_scripts.recipes.generation_params import GenerationParams

PARAMETERS = tuple(field.name for field in dataclasses.fields(GenerationParams))
ANSWER_POLL_SECONDS = 0.1  # how soon a client's cancellation is seen while it waits


class BadRequest(ValueError):
    """A request that cannot be served: one line for its client."""


def decoded(line: bytes) -> Any:
    try:
        return json.loads(line)
    except (ValueError, UnicodeDecodeError) as error:
        raise BadRequest(f"the request is not JSON: {error}") from None


def parse(request: Any) -> tuple[list[str], GenerationParams, bool]:
    """(prompts, params, stream) of a decoded request, or BadRequest naming what is wrong."""
    if not isinstance(request, dict):
        raise BadRequest("the request must be a JSON object with prompts and params")
    unknown = sorted(set(request) - {"prompts", "params", "stream"})
    if unknown:
        raise BadRequest(f"unknown key {unknown[0]}: a request has prompts, params and stream")
    prompts = request.get("prompts")
    if not isinstance(prompts, list) or not prompts:
        raise BadRequest("prompts: give a non-empty list of strings or of token-id lists")
    raw = request.get("params") or {}
    if not isinstance(raw, dict):
        raise BadRequest("params: give an object of generation parameters")
    for name in raw:
        if name not in PARAMETERS:
            close = difflib.get_close_matches(name, PARAMETERS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else f" (known: {', '.join(PARAMETERS)})"
            raise BadRequest(f"params.{name} is not a generation parameter{hint}")
    if isinstance(raw.get("stop_words"), list):
        raw = {**raw, "stop_words": tuple(raw["stop_words"])}
    params = GenerationParams(**raw)
    try:
        params.check()
    except ValueError as error:
        raise BadRequest(f"params.{error}") from None
    stream = request.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream: give true or false")
    if stream and (len(prompts) != 1 or params.beam_width != 1):
        raise BadRequest("stream: one prompt per request, and beam_width 1")
    return prompts, params, stream


def too_many_tokens(prompts: int, params: GenerationParams, limit: int | None) -> str | None:
    """Why a request asks for more generation than one request may (the export's
    max_request_tokens), or None. Generation's time grows with every beam's every token: a
    request over the limit would hold its slots, and every client waiting, for minutes."""
    beams, tokens = params.beam_width, params.tokens_to_generate
    total = prompts * beams * tokens
    if limit is None or total <= limit:
        return None
    if beams > 1 and limit // (prompts * tokens) >= 1:
        advice = f"lower beam_width to at most {limit // (prompts * tokens)}"
    elif limit // (prompts * beams) >= 1:
        advice = f"lower tokens_to_generate to at most {limit // (prompts * beams)}"
    else:
        advice = "send fewer prompts per request"
    return (
        f"the request asks for {total} generated tokens ({prompts} prompt(s) x beam_width "
        f"{beams} x tokens_to_generate {tokens}), more than the {limit} one request may ask "
        f"for on this server (the export's triton_deployment.max_request_tokens): {advice}"
    )


def tokenizer_answer(tokenizer: Any, request: dict[str, Any]) -> dict[str, Any]:
    """The answer to a tokenize or detokenize request (BadRequest naming what is wrong)."""
    from launcher_scripts.jobs.inference.generation import continuation_text, prompt_ids

    if "tokenize" in request:
        if set(request) != {"tokenize"}:
            raise BadRequest("a tokenize request has the one key tokenize")
        texts = request["tokenize"]
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise BadRequest("tokenize: give a list of strings")
        return {"ids": [tokenizer.encode(text) for text in texts]}
    if not set(request) <= {"detokenize", "after"}:
        raise BadRequest("a detokenize request has the keys detokenize and after")
    generated = request["detokenize"]
    after = request.get("after") or [[]] * (len(generated) if isinstance(generated, list) else 0)
    if not isinstance(generated, list) or not isinstance(after, list):
        raise BadRequest("detokenize and after: give lists of token-id lists")
    if len(after) != len(generated):
        raise BadRequest(
            f"after has {len(after)} prompt(s) for {len(generated)} generated sequence(s): "
            "give one prompt's ids (or []) per sequence"
        )
    texts = []
    for index, (ids, prompt) in enumerate(zip(generated, after, strict=True)):
        name = f"sequence {index}"
        checked = prompt_ids(tokenizer, ids, name) if ids else []
        before = prompt_ids(tokenizer, prompt, f"{name}'s prompt") if prompt else []
        texts.append(continuation_text(tokenizer, before, checked))
    return {"texts": texts}


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        line = self.rfile.readline()
        if not line.strip():
            return
        try:
            request = decoded(line)
            if request == {"stats": True}:
                self._send(self.server.stats())
                return
            if isinstance(request, dict) and {"tokenize", "detokenize"} & set(request):
                self._send(tokenizer_answer(self.server.served.tokenizer, request))
                return
            prompts, params, stream = parse(request)
            prompt_tokens = self.server.check_lengths(prompts, params)
            problem = too_many_tokens(len(prompts), params, self.server.max_request_tokens)
            if problem:
                raise BadRequest(problem)
            pieces: queue.Queue[str | None] = queue.Queue()
            listener = _stream_listener(pieces) if stream else None
            future = self.server.loop.submit(prompts, params, listener)
        except ValueError as error:  # BadRequest, Refused, a prompt too long for the model
            self._send({"error": str(error), "status": 400})
            return
        # A client that closes its connection before its answer frees its slots. The watch is
        # stopped after the answer is sent: its clients read up to the answer, not to the end.
        watch = HangupWatch(self.connection, partial(self.server.loop.cancel, future))
        try:
            self._answer(future, pieces if stream else None, prompt_tokens)
        finally:
            watch.stop()

    def _answer(
        self, future: Any, pieces: queue.Queue[str | None] | None, prompt_tokens: list[int]
    ) -> None:
        """The request's answer: its stream's pieces then its end, or its texts; or its error."""
        try:
            if pieces is not None:
                self._relay(pieces, future)
            completions = future.result()
        except Exception as error:  # noqa: BLE001  (the request's own failure, one line)
            with contextlib.suppress(OSError):
                self._send({"error": f"{type(error).__name__}: {error}", "status": 500})
            return
        with contextlib.suppress(OSError):  # the client may be gone by now
            if pieces is not None:
                self._send({"finish_reason": completions[0].finish_reason, "done": True})
            else:
                self._send(
                    {
                        "texts": [c.text for c in completions],
                        "tokens": [c.tokens for c in completions],
                        "finish_reasons": [c.finish_reason for c in completions],
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": [len(c.tokens) for c in completions],
                    }
                )

    def _relay(self, pieces: queue.Queue[str | None], future: Any) -> None:
        """Send the stream's pieces as they come, until its end (or its failure)."""
        while True:
            try:
                piece = pieces.get(timeout=0.1)
            except queue.Empty:
                if future.done():
                    return
                continue
            if piece is None:
                return
            self._send({"text": piece})

    def _send(self, message: dict[str, Any]) -> None:
        self.wfile.write(json.dumps(message).encode() + b"\n")
        self.wfile.flush()


def _stream_listener(pieces: queue.Queue[str | None]) -> Any:
    from launcher_scripts.jobs.inference.generation import StreamedText

    text: list[StreamedText] = []

    def listen(task: Any) -> None:
        if not text:
            text.append(StreamedText(task))
        piece = text[0].ready()
        if piece:
            pieces.put(piece)
        if task.done:
            pieces.put(None)

    return listen


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    request_queue_size = 256  # clients arrive together; the default 5 refuses the sixth

    def __init__(self, path: Path, loop: Any, served: Any, max_request_tokens: int | None) -> None:
        self.loop, self.served = loop, served
        self.max_request_tokens = max_request_tokens
        super().__init__(str(path), _Handler)

    def check_lengths(self, prompts: list[Any], params: GenerationParams) -> list[int]:
        """Each prompt against the model's positions, in its family's words (served.too_long);
        the prompts' token counts."""
        from launcher_scripts.jobs.inference.generation import prompt_ids

        counts = []
        for index, prompt in enumerate(prompts):
            name = "prompt" if len(prompts) == 1 else f"prompt {index}"
            try:
                tokens = len(prompt_ids(self.served.tokenizer, prompt, name))
            except ValueError as error:
                raise BadRequest(str(error)) from None
            problem = self.served.too_long(tokens, params.tokens_to_generate)
            if problem:
                raise BadRequest(problem)
            counts.append(tokens)
        return counts

    def stats(self) -> dict[str, int]:
        return {"live": len(self.loop.engine.cache.live), "steps": self.loop.engine.steps}


class Withdrawn(Exception):
    """The asker stopped waiting (its client went away): the connection to the model server
    was closed, which makes it drop the request."""


def answer_lines(
    path: str | Path,
    request: dict[str, Any],
    cancelled: Callable[[], bool] | None = None,
    timeout: float | None = None,
) -> Iterator[dict[str, Any]]:
    """Send one request to a model server and yield its answer lines as they come, ending
    after the last one (an answer, a stream's end, an error, stats). Raises Withdrawn as soon
    as `cancelled()`, ConnectionError if the server closes without an answer, TimeoutError
    after `timeout` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(str(path))
        connection.sendall(json.dumps(request).encode() + b"\n")
        buffered = b""
        while True:
            readable, _, _ = select.select([connection], [], [], ANSWER_POLL_SECONDS)
            if cancelled is not None and cancelled():
                raise Withdrawn()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no answer from the model server in {timeout:.0f} s")
            if not readable:
                continue
            chunk = connection.recv(65536)
            if not chunk:
                raise ConnectionError("the model server closed the connection without an answer")
            buffered += chunk
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                answer = json.loads(line)
                yield answer
                if "text" not in answer:
                    return


def ask(path: str | Path, request: dict[str, Any], timeout: float = 300) -> list[dict[str, Any]]:
    """Send one request to a model server; every line it answers, in order."""
    return list(answer_lines(path, request, timeout=timeout))


def cache_problem(served: Any, slots: int) -> str | None:
    """Why this process cannot hold `slots` sequences (memory.py), or None."""
    from launcher_scripts.jobs.inference import memory

    decoding, positions = served.decoding, served.max_length
    measure = getattr(decoding, "cache_bytes_per_slot", None)
    per_slot = measure(positions) if measure is not None else 0
    budget = memory.budget_now(served.on_gpu)
    return memory.slots_problem(served.shape, budget, slots, positions, per_slot)


def follow_stop(world_size: int) -> None:
    """Release the other ranks (they wait in follow()) when rank 0 gives up before serving."""
    if world_size > 1:
        from launcher_scripts.jobs.inference.broadcast_cache import Leader

        Leader(None).stop()


def serve(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from launcher_scripts.jobs.inference.broadcast_cache import Leader, follow
    from launcher_scripts.jobs.inference.engine_loop import EngineLoop
    from launcher_scripts.jobs.inference.runner import close_runner
    from launcher_scripts.jobs.inference.served import open_served

    on_gpu = False if args.cpu else None
    served = open_served(args.model, args.tensor, args.pipeline, on_gpu=on_gpu)
    try:
        if dist.get_rank() != 0:
            follow(served.decoding)
            return 0
        problem = cache_problem(served, args.slots)
        if problem:
            print(f"error: {problem}", file=sys.stderr, flush=True)
            follow_stop(dist.get_world_size())
            return 2
        leader = Leader(served.decoding)
        loop = EngineLoop(leader, served.tokenizer, args.slots, served.max_length)
        path = Path(args.socket)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        server = _Server(path, loop, served, args.max_request_tokens)
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        print(f"model server: {args.model} at TP={args.tensor} x PP={args.pipeline}, "
              f"{args.slots} slots, listening on {path}", flush=True)  # fmt: skip
        stop.wait()
        server.shutdown()
        loop.close()
        leader.stop()
        path.unlink(missing_ok=True)
        return 0
    finally:
        close_runner()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--tensor", type=int, default=1)
    parser.add_argument("--pipeline", type=int, default=1)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even with a GPU")
    parser.add_argument(
        "--max-request-tokens",
        type=int,
        default=None,
        help="refuse requests asking for more prompts x beam_width x tokens_to_generate",
    )
    args = parser.parse_args(argv)
    if args.slots < 1:
        parser.error(f"--slots {args.slots}: give 1 or more")
    if len(os.fsencode(args.socket)) > 100:
        parser.error(f"--socket {args.socket}: a Unix socket path must be under 100 bytes")
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
