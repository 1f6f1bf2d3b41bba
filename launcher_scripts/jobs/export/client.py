"""`python3 -m launcher_scripts client SERVER PROMPT...`: text in, text out through a served
export's ensemble (preprocessing -> the model on ids -> postprocessing), the end-to-end check
the reference's section 6.2 runs with FasterTransformer's end_to_end_test.py.

SERVER is the HTTP address `serve` printed (host:port or http://host:port), or the export
folder (or its endpoint.json) of a server started with `serve --slurm`, which writes where it
listens there. Only the standard library: it runs on any machine that reaches the server.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from launcher_scripts.recipes.triton_interface import (
    ENSEMBLE,
    FINISH_REASON,
    OUTPUT_IDS,
    PARAMETERS,
    SEQUENCE_LENGTH,
    TEXT_INPUT,
    TEXT_OUTPUT,
)

ENDPOINT_FILE = "endpoint.json"


class ClientError(Exception):
    """A problem the user can fix, in one line."""


def server_url(server: str) -> str:
    """The HTTP base URL of SERVER: an address, an endpoint.json, or the folder holding one."""
    path = Path(server)
    if path.is_dir():
        path = path / ENDPOINT_FILE
        if not path.is_file():
            raise ClientError(
                f"{server} holds no {ENDPOINT_FILE}: give the address `serve` printed "
                "(host:port), or wait until a `serve --slurm` job says it is ready"
            )
    if path.is_file():
        try:
            address = json.loads(path.read_text())["http"]
        except (ValueError, KeyError, TypeError):
            raise ClientError(f"{path} is not an endpoint file written by serve") from None
        return f"http://{address}"
    if "://" not in server:
        server = f"http://{server}"
    if not server.startswith(("http://", "https://")):
        raise ClientError(f"{server}: give an http:// address, host:port, or an export folder")
    return server.rstrip("/")


def infer_request(prompts: list[str], values: dict[str, Any]) -> dict[str, Any]:
    """A KServe v2 inference request: one row per prompt, each parameter given repeated."""
    rows = len(prompts)
    inputs = [
        {"name": TEXT_INPUT, "datatype": "BYTES", "shape": [rows, 1], "data": prompts},
    ]
    for parameter in PARAMETERS:
        value = values.get(parameter.name)
        if value is None:
            continue
        if parameter.many:
            data = [list(value)] * rows
            shape = [rows, len(value)]
        else:
            data, shape = [value] * rows, [rows, 1]
        inputs.append(
            {
                "name": parameter.name,
                "datatype": parameter.client_type,
                "shape": shape,
                "data": data,
            }
        )
    return {"inputs": inputs}


def infer(url: str, model: str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
    target = f"{url}/v2/models/{model}/infer"
    body = json.dumps(request).encode()
    headers = {"Content-Type": "application/json"}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(target, data=body, headers=headers), timeout=timeout
        ) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        try:
            message = json.loads(error.read()).get("error", error.reason)
        except ValueError:
            message = error.reason
        raise ClientError(f"{target}: HTTP {error.code}: {message}") from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise ClientError(
            f"{target}: {reason}: is the server running (python3 -m launcher_scripts serve)?"
        ) from None


def outputs_of(answer: dict[str, Any]) -> dict[str, list[Any]]:
    """Each output's flat data, by name."""
    return {output["name"]: output["data"] for output in answer.get("outputs", [])}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 -m launcher_scripts client",
        description="Send prompts to a served export's ensemble and print what it generates.",
    )
    parser.add_argument("server", help="host:port, http://host:port, or the export folder")
    parser.add_argument("prompts", nargs="+", metavar="PROMPT")
    parser.add_argument("--model", default=ENSEMBLE, help=f"the model to ask (default {ENSEMBLE})")
    parser.add_argument("--ids", action="store_true", help="print the generated token ids too")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait (600)")
    for parameter in PARAMETERS:
        kind = {"INT32": int, "UINT64": int, "FP32": float}.get(parameter.client_type, str)
        parser.add_argument(
            f"--{parameter.name.replace('_', '-')}",
            dest=parameter.name,
            type=kind,
            action="append" if parameter.many else "store",
            help="repeat for several" if parameter.many else "the export's default if not given",
        )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    values = {parameter.name: getattr(args, parameter.name) for parameter in PARAMETERS}
    try:
        url = server_url(args.server)
        answer = outputs_of(
            infer(url, args.model, infer_request(args.prompts, values), args.timeout)
        )
        texts = answer.get(TEXT_OUTPUT)
        if texts is None:
            raise ClientError(f"the model {args.model} returned no {TEXT_OUTPUT}: ask a text model")
    except ClientError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    reasons = answer.get(FINISH_REASON, [""] * len(texts))
    lengths = answer.get(SEQUENCE_LENGTH)
    ids = answer.get(OUTPUT_IDS)
    width = len(ids) // len(texts) if ids and lengths else 0
    for row, (prompt, text, reason) in enumerate(zip(args.prompts, texts, reasons, strict=True)):
        print(f"{prompt}{text}  [{reason}]")
        if args.ids and width:
            print(f"  ids: {ids[row * width : row * width + lengths[row]]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
