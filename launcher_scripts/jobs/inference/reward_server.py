"""The reward model's inference server (the reference's 5.16.2.1): texts in, rewards out.

    python3 -m launcher_scripts serve-reward MODEL.nemo [--port 5555] [--host 127.0.0.1]

MODEL.nemo is what the rlhf_rm stage writes. Over HTTP, one JSON object per request:

    POST /rewards  {"texts": ["a prompt and its answer", ...], "normalize": false}
      -> 200 {"rewards": [1.25, ...]}
    GET /health    -> 200 {"ready": true, "model": "...", "mean": ..., "std": ...}

A text's reward is the model's value at its last token (no end-of-document token is added:
the reward model was trained so). `normalize` true gives (reward - mean) / std, with the mean
and std of the rewards over its validation pairs that the file records (the reference's
5.16.1.3 normalisation, which PPO applies). A bad request gets 400 and one line saying what to
change; nothing else stops the server. Requests are answered one batch at a time, each request's
texts in one batch. This version serves at TP1/PP1, in one process, on the GPU when there is
one.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from launcher_scripts.formats.portable import REWARD_MODEL
from launcher_scripts.jobs.json_handler import JsonHandler

MAX_BODY = 64 * 2**20


class RequestError(ValueError):
    """What the client must change, in one line."""


class Scorer:
    """A reward model opened for inference: rewards of batches of texts."""

    def __init__(self, model_file: Path, on_gpu: bool | None = None) -> None:
        from launcher_scripts.jobs.inference.runner import InferenceError, open_model
        from launcher_scripts.jobs.inference.text_tokenizer import load_text_tokenizer

        opened = open_model(model_file, 1, 1, on_gpu)
        section = opened.config.get(REWARD_MODEL)
        if section is None:
            raise InferenceError(
                f"{model_file} is not a reward model (its model_config.yaml has no "
                f"{REWARD_MODEL} section): give the .nemo file the rlhf_rm stage writes"
            )
        (self.chunk,) = opened.chunks
        self.on_gpu = opened.on_gpu
        self.tokenizer = load_text_tokenizer(opened.config.tokenizer)
        self.max_length = int(opened.config.max_position_embeddings)
        self.mean, self.std = float(section.mean), float(section.std)
        self.lock = threading.Lock()

    def encode(self, texts: Any) -> list[list[int]]:
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError('"texts" must be a non-empty list of strings')
        rows = self.tokenizer.encode_batch(texts)
        for index, ids in enumerate(rows):
            if not ids:
                raise RequestError(f"texts[{index}] is empty: give each text at least one token")
            if len(ids) > self.max_length:
                raise RequestError(
                    f"texts[{index}] is {len(ids)} tokens, over the model's {self.max_length} "
                    "positions: shorten it"
                )
        return rows

    @torch.no_grad()
    def rewards(self, rows: list[list[int]], normalize: bool = False) -> list[float]:
        longest = max(len(ids) for ids in rows)
        device = torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else None
        tokens = torch.full((len(rows), longest), self.tokenizer.eod_id, dtype=torch.long)
        for index, ids in enumerate(rows):
            tokens[index, : len(ids)] = torch.tensor(ids)
        positions = torch.arange(longest).expand(len(rows), -1)
        lengths = torch.tensor([len(ids) for ids in rows])
        hidden = torch.ones(longest, longest, dtype=torch.bool).triu(diagonal=1)[None, None]
        with self.lock:
            values = self.chunk(tokens.to(device), positions.to(device), hidden.to(device))
        values = values[..., 0]
        rewards = values.float().cpu()[torch.arange(len(rows)), lengths - 1]
        if normalize:
            rewards = (rewards - self.mean) / max(self.std, 1e-6)
        return rewards.tolist()


def handler_for(scorer: Scorer, name: str) -> type[BaseHTTPRequestHandler]:
    class Handler(JsonHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path != "/health":
                self._answer(404, {"error": f"{self.path}: use GET /health or POST /rewards"})
                return
            self._answer(
                200, {"ready": True, "model": name, "mean": scorer.mean, "std": scorer.std}
            )

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/rewards":
                self._answer(404, {"error": f"{self.path}: POST to /rewards"})
                return
            try:
                size = int(self.headers.get("Content-Length") or 0)
                if not 0 < size <= MAX_BODY:
                    raise RequestError(f"send a JSON body of 1 to {MAX_BODY} bytes")
                try:
                    request = json.loads(self.rfile.read(size))
                except json.JSONDecodeError as error:
                    raise RequestError(f"the body is not JSON ({error.msg})") from None
                if not isinstance(request, dict):
                    raise RequestError('send a JSON object: {"texts": [...]}')
                normalize = request.get("normalize", False)
                if not isinstance(normalize, bool):
                    raise RequestError('"normalize" must be true or false')
                rows = scorer.encode(request.get("texts"))
                self._answer(200, {"rewards": scorer.rewards(rows, normalize)})
            except RequestError as error:
                self._answer(400, {"error": str(error)})

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m launcher_scripts serve-reward", description=__doc__.splitlines()[0]
    )
    parser.add_argument("model", type=Path, help="the reward model's .nemo (rlhf_rm's output)")
    parser.add_argument("--port", type=int, default=5555, help="0: any free port")
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to accept other hosts")
    args = parser.parse_args(argv)
    from launcher_scripts.jobs.inference.runner import InferenceError, close_runner

    try:
        scorer = Scorer(args.model)
    except (InferenceError, OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    server = ThreadingHTTPServer((args.host, args.port), handler_for(scorer, args.model.name))
    host, port = server.server_address[:2]
    # scancel's and a container's stop (SIGTERM) end it as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"ready: reward model {args.model.name} at http://{host}:{port}/rewards", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        close_runner()
    print("stopped: the reward server has shut down", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
