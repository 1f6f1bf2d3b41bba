"""PPO's served roles (the rlhf_ppo stage with `model.rlhf.layout: servers`, the reference's
5.16.2.1-3): the reward model, the initial policy and the critic, each a job of its own that the
actor's job calls over HTTP.

    python -m launcher_scripts.jobs.fine_tuning.ppo_server --config F --stage S --role R

R is reward_model, initial_policy or critic. Every rank of the server's job holds its share of
the model (its ranks are one tensor-parallel group); rank 0 answers HTTP and hands each request
to every rank in turn. Once it listens, it writes `servers/<role>.json` ({"url", "host",
"pid"}) under the stage's results folder, which the actor reads. Requests, JSON in and out
(rows: token ids of prompt and completion, without padding):

    reward_model   POST /scores  {"rows"}                  -> {"scores": [..]} (standardised
                                                              with the file's mean and std when
                                                              the recipe says normalize)
    initial_policy POST /logps   {"rows"}                  -> {"logps": [[log p(row[i+1])]]}
    critic         POST /values  {"rows"}                  -> {"values": [[v(row[:i+1])]]}
                   POST /train   {"rows", "masks", "returns", "old_values"}  one optimizer step
                                                           -> {"sums": {..}}
                   POST /save    {}                        a checkpoint of its step
                   POST /state   {}                        -> {"step": n}
    any            POST /stop    {}                        the server ends (exit 0)

The critic trains with the pretraining loop (checkpoints in `critic/checkpoints/`, resumed at
start), on the actor's mini-batches, one step each. A request the server cannot answer gets 400
and one line; the server stays up.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import queue
import socket
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from launcher_scripts.jobs.json_handler import JsonHandler
from launcher_scripts.jobspec import MAIN_HOST_VARIABLE

ROLES = ("reward_model", "initial_policy", "critic")
IDLE_TICK_S = 20.0  # rank 0 wakes the other ranks this often while no request comes
MAX_BODY = 256 * 2**20


def address_file(log_dir: Path, role: str) -> Path:
    return log_dir / "servers" / f"{role}.json"


class RequestError(ValueError):
    """What the client must change, in one line."""


@dataclass
class Pending:
    kind: str
    body: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    sent: threading.Event = field(default_factory=threading.Event)
    status: int = 200
    answer: dict[str, Any] = field(default_factory=dict)


def _handler(requests: queue.Queue) -> type[BaseHTTPRequestHandler]:
    class Handler(JsonHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            length = int(self.headers.get("Content-Length") or 0)
            try:
                if length > MAX_BODY:
                    raise RequestError(f"the body is {length} bytes; at most {MAX_BODY}")
                body = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(body, dict):
                    raise RequestError("the body must be a JSON object")
            except (RequestError, ValueError) as error:
                self._answer(400, {"error": str(error)})
                return
            pending = Pending(self.path.strip("/"), body)
            requests.put(pending)
            pending.done.wait()
            self._answer(pending.status, pending.answer)
            pending.sent.set()

    return Handler


def serve(handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]], address: Path) -> int:
    """Answer requests until /stop: rank 0 listens and passes each request to every rank,
    which all run its handler; rank 0 sends the answer."""
    import torch.distributed as dist

    rank = dist.get_rank()
    requests: queue.Queue = queue.Queue()
    if rank == 0:
        server = ThreadingHTTPServer(("0.0.0.0", 0), _handler(requests))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        host = advertised_host()
        url = f"http://{host}:{server.server_address[1]}"
        address.parent.mkdir(parents=True, exist_ok=True)
        scratch = address.with_name(address.name + ".tmp")
        scratch.write_text(json.dumps({"url": url, "host": host, "pid": os.getpid()}))
        scratch.replace(address)
        print(f"serving {address.stem} at {url} ({address})", flush=True)
    while True:
        pending: Pending | None = None
        message: list[Any] = [None, None]
        if rank == 0:
            try:
                pending = requests.get(timeout=IDLE_TICK_S)
                message = [pending.kind, pending.body]
            except queue.Empty:
                message = ["tick", None]
        dist.broadcast_object_list(message, src=0)
        kind, body = message
        if kind == "tick":
            continue
        if kind == "stop":
            if pending is not None:
                pending.done.set()
                pending.sent.wait(timeout=10)  # the answer out before the process ends
            return 0
        handler = handlers.get(kind)
        try:
            if handler is None:
                raise RequestError(f"/{kind} is not a request of this server: {sorted(handlers)}")
            answer, status = handler(body), 200
        except (RequestError, ValueError, KeyError, TypeError) as error:
            answer, status = {"error": f"/{kind}: {error}"}, 400
        if pending is not None:
            pending.answer, pending.status = answer, status
            pending.done.set()


def advertised_host() -> str:
    """Where the actor reaches this server: the local address of the route to the actor's node
    when the job script names it (Slurm: another node, perhaps on another network), else this
    host's name."""
    main = os.environ.get(MAIN_HOST_VARIABLE)
    if main:
        try:
            target = socket.gethostbyname(main)
            if not ipaddress.ip_address(target).is_loopback:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                    probe.connect((target, 9))  # no packet: only the route is looked up
                    return str(probe.getsockname()[0])
        except OSError:
            pass
    return socket.gethostname()


def _rows(body: dict[str, Any]) -> list[list[int]]:
    rows = body.get("rows")
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) and r for r in rows):
        raise RequestError("give 'rows': a list of non-empty lists of token ids")
    return rows


# ----- the served models ----------------------------------------------------------------------


def _runner(model_file: Path, scratch: Path, on_gpu: bool, scalar: bool) -> tuple[Any, Any]:
    """A ModelRunner over every rank of this job (one tensor-parallel group), and the file."""
    import torch.distributed as dist

    from launcher_scripts.formats import portable
    from launcher_scripts.jobs.conversion import load
    from launcher_scripts.jobs.inference.runner import ModelRunner
    from launcher_scripts.jobs.inference.text_tokenizer import load_text_tokenizer

    tensor = dist.get_world_size()
    loaded = portable.read(model_file, scratch)
    chunks = load.build(loaded, tensor, 1, on_gpu)
    runner = ModelRunner(
        chunks=chunks,
        tokenizer=load_text_tokenizer(loaded.config.tokenizer),
        max_length=int(loaded.config.max_position_embeddings),
        vocab_size=1 if scalar else int(loaded.tensors.shape(portable.EMBEDDINGS)[0]),
        tensor=tensor,
        pipeline=1,
        on_gpu=on_gpu,
        scalar=scalar,
    )
    return runner, loaded


def reward_handlers(settings: Any, scratch: Path, on_gpu: bool) -> dict[str, Callable]:
    from launcher_scripts.formats.portable import REWARD_MODEL

    runner, loaded = _runner(settings.reward.path, scratch, on_gpu, scalar=True)
    section = loaded.config[REWARD_MODEL]
    mean, std = float(section.mean), max(float(section.std), 1e-6)

    def scores(body: dict[str, Any]) -> dict[str, Any]:
        rows = _rows(body)
        values = runner.logits(rows)[..., 0]
        found = [float(values[i, len(row) - 1]) for i, row in enumerate(rows)]
        if settings.reward.normalize:
            found = [(value - mean) / std for value in found]
        return {"scores": found}

    return {"scores": scores}


def policy_handlers(base: Path, scratch: Path, on_gpu: bool) -> dict[str, Callable]:
    runner, _loaded = _runner(base, scratch, on_gpu, scalar=False)

    def logps(body: dict[str, Any]) -> dict[str, Any]:
        rows = _rows(body)
        logits = runner.logits(rows).float()
        found = []
        for index, row in enumerate(rows):
            labels = torch.tensor(row[1:], dtype=torch.long)
            log_probs = torch.log_softmax(logits[index, : len(row) - 1], dim=-1)
            found.append(log_probs.gather(1, labels[:, None])[:, 0].tolist())
        return {"logps": found}

    return {"logps": logps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--stage", required=True)
    parser.add_argument("--role", required=True, choices=ROLES)
    args = parser.parse_args(argv)
    recipe_cfg = OmegaConf.load(args.config)
    from launcher_scripts.formats.tokenizer import TokenizerError
    from launcher_scripts.jobs.refusal import refuse
    from launcher_scripts.jobs.training import runtime
    from launcher_scripts.jobs.training.runtime import JobError, init_model_parallel
    from launcher_scripts.recipes import training as recipe
    from launcher_scripts.recipes.tuning import read_spec

    on_gpu, info = runtime.start_job(recipe_cfg)
    try:
        spec = read_spec(recipe_cfg, args.stage)
        log_dir = Path(str(recipe_cfg.exp_manager.explicit_log_dir))
        log_dir.mkdir(parents=True, exist_ok=True)
        runtime.init_distributed(info, on_gpu, recipe.rendezvous_timeout(recipe_cfg))
        import torch.distributed as dist

        address = address_file(log_dir, args.role)
        with tempfile.TemporaryDirectory(dir=log_dir, prefix=f".{args.role}-") as scratch:
            if args.role == "critic":
                from launcher_scripts.jobs.fine_tuning.ppo_critic import critic_handlers

                handlers = critic_handlers(recipe_cfg, spec, on_gpu, Path(scratch))
                return serve(handlers, address)
            layout = _one_group(dist.get_world_size())
            init_model_parallel(layout, int(recipe_cfg.model.get("seed", 1234)), on_gpu)
            if args.role == "reward_model":
                handlers = reward_handlers(spec.objective, Path(scratch), on_gpu)
            else:
                handlers = policy_handlers(spec.base_model, Path(scratch), on_gpu)
            return serve(handlers, address)
    except (JobError, RequestError, TokenizerError) as error:
        return refuse(error)
    finally:
        runtime.shutdown()


def _one_group(world: int) -> Any:
    """This job's ranks as one tensor-parallel group."""
    from launcher_scripts.recipes.layout import Layout

    return Layout(num_nodes=1, gpus_per_node=world, tensor=world)


if __name__ == "__main__":
    sys.exit(main())
