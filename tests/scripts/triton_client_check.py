"""Requests to a running Triton server through tritonclient (HTTP and gRPC), printed as JSON.
Runs under the Triton environment's python, where tritonclient is installed:

<venv>/bin/python -m tests.scripts.triton_client_check MODEL HTTP_PORT GRPC_PORT PROMPTS_JSON
"""

from __future__ import annotations

import json
import queue
import sys
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpc
import tritonclient.http as http


def http_inputs(prompts: list[str], **parameters: Any) -> list[Any]:
    inputs = []
    arrays = {"text_input": np.array([[p] for p in prompts], dtype=object)}
    arrays |= {name: np.array([[v]] * len(prompts)) for name, v in parameters.items()}
    for name, array in arrays.items():
        kind = "BYTES" if array.dtype == object else np_to_triton(array.dtype)
        tensor = http.InferInput(name, list(array.shape), kind)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def np_to_triton(dtype: np.dtype) -> str:
    return {"int32": "INT32", "float32": "FP32", "uint64": "UINT64"}[str(dtype)]


def texts(result: Any) -> list[str]:
    return [row[0].decode() for row in result.as_numpy("text_output")]


def error_of(call: Any) -> str:
    try:
        call()
    except Exception as error:  # tritonclient's InferenceServerException
        return str(error)
    return ""


def main() -> None:
    model, http_port, grpc_port, prompts_file = sys.argv[1:5]
    prompts = json.loads(Path(prompts_file).read_text())
    client = http.InferenceServerClient(f"localhost:{http_port}")
    n = np.int32
    out: dict[str, Any] = {}
    out["http_batch"] = texts(client.infer(model, http_inputs(prompts, tokens_to_generate=n(12))))
    out["http_single"] = [
        texts(client.infer(model, http_inputs([p], tokens_to_generate=n(12))))[0] for p in prompts
    ]
    out["http_beam"] = texts(
        client.infer(model, http_inputs(prompts[:1], tokens_to_generate=n(8), beam_width=n(3)))
    )
    sampled = {
        "tokens_to_generate": n(12),
        "top_k": n(0),
        "top_p": np.float32(0.9),
        "temperature": np.float32(1.0),
        "random_seed": np.uint64(7),
    }
    out["http_sampled"] = [
        texts(client.infer(model, http_inputs(prompts[:1], **sampled)))[0] for _ in range(2)
    ]
    stops = http_inputs(prompts[:1], tokens_to_generate=n(12))
    words = http.InferInput("stop_words", [1, 1], "BYTES")
    words.set_data_from_numpy(np.array([["."]], dtype=object))
    out["http_stop"] = [
        texts(result)[0] + "|" + result.as_numpy("finish_reason")[0][0].decode()
        for result in [client.infer(model, [*stops, words])]
    ]

    wrong_type = http.InferInput("top_k", [1, 1], "FP32")
    wrong_type.set_data_from_numpy(np.array([[1.5]], dtype=np.float32))
    out["errors"] = {
        "missing_text": error_of(
            lambda: client.infer(model, http_inputs(prompts[:1], top_k=n(1))[1:])
        ),
        "wrong_dtype": error_of(
            lambda: client.infer(model, [http_inputs(prompts[:1])[0], wrong_type])
        ),
        "too_many_tokens": error_of(
            lambda: client.infer(model, http_inputs(prompts[:1], tokens_to_generate=n(100000)))
        ),
        "bad_top_p": error_of(
            lambda: client.infer(model, http_inputs(prompts[:1], top_p=np.float32(2.0)))
        ),
        "stream_beam": "",
    }
    # Still serving after the bad requests.
    out["http_after_errors"] = texts(
        client.infer(model, http_inputs(prompts[:1], tokens_to_generate=n(12)))
    )
    client.close()

    stream = grpc.InferenceServerClient(f"localhost:{grpc_port}")
    out["grpc"] = [
        stream.infer(model, grpc_inputs(p, 12)).as_numpy("text_output")[0][0].decode()
        for p in prompts
    ]
    out["stream_pieces"] = streamed(stream, model + "_stream", prompts[0], 12, beam_width=1)
    out["errors"]["stream_beam"] = streamed(stream, model + "_stream", prompts[0], 12, beam_width=3)
    stream.close()
    print(json.dumps(out))


def grpc_inputs(prompt: str, tokens: int, beam_width: int = 1) -> list[Any]:
    text = grpc.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[prompt]], dtype=object))
    count = grpc.InferInput("tokens_to_generate", [1, 1], "INT32")
    count.set_data_from_numpy(np.array([[tokens]], dtype=np.int32))
    beams = grpc.InferInput("beam_width", [1, 1], "INT32")
    beams.set_data_from_numpy(np.array([[beam_width]], dtype=np.int32))
    return [text, count, beams]


def streamed(client: Any, model: str, prompt: str, tokens: int, beam_width: int) -> Any:
    """The text pieces of one streamed request, or the error text."""
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(
        model, grpc_inputs(prompt, tokens, beam_width), enable_empty_final_response=True
    )
    pieces = []
    try:
        while True:
            result, error = responses.get(timeout=120)
            if error is not None:
                return str(error)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return pieces
            pieces.append(result.as_numpy("text_output")[0][0].decode())
    finally:
        client.stop_stream()


if __name__ == "__main__":
    main()
