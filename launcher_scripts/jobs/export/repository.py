"""The Triton model repository the export stage writes:

    <model_repository>/
      <model_name>/config.pbtxt          Python backend, dynamic batching
      <model_name>/1/model.py            imports the launcher's Triton model
      <model_name>/1/model.nemo          the portable checkpoint being served
      <model_name>_stream/config.pbtxt   the same model, decoupled: streams text as it is made
      <model_name>_stream/1/model.py

Two models because Triton answers plain (HTTP or gRPC) inference only from non-decoupled models
and streams only from decoupled ones. Both are thin clients of one model server, which `serve`
starts on the first one's weights file (jobs/inference/model_server.py).

Rendering is pure (`render_config`); `write_repository` fills a folder, which the export job
builds beside the repository, checks, and swaps in whole only when the check passed.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from launcher_scripts.recipes.triton_interface import (
    FINISH_REASON,
    MAX_REQUEST_TOKENS,
    PARAMETERS,
    PIPELINE_PARALLEL,
    STREAM_SUFFIX,
    TENSOR_PARALLEL,
    TEXT_INPUT,
    TEXT_OUTPUT,
)

MODEL_FILE = "model.nemo"
PLAIN_INSTANCES = 4
VERSION = "1"


def _quote(value: str) -> str:
    return json.dumps(value)  # protobuf text format accepts JSON's string escapes


def _tensor(name: str, data_type: str, dims: Iterable[int], optional: bool) -> str:
    lines = [
        f"    name: {_quote(name)}",
        f"    data_type: {data_type}",
        f"    dims: [ {', '.join(str(d) for d in dims)} ]",
    ]
    if optional:
        lines.append("    optional: true")
    return "  {\n" + "\n".join(lines) + "\n  }"


def _parameter(key: str, value: str) -> str:
    return f"parameters {{\n  key: {_quote(key)}\n  value: {{ string_value: {_quote(value)} }}\n}}"


def render_config(
    name: str,
    *,
    max_batch_size: int,
    max_queue_delay_microseconds: int,
    decoupled: bool,
    model_file: str,
    defaults: Mapping[str, Any],
    max_request_tokens: int,
    tensor: int = 1,
    pipeline: int = 1,
) -> str:
    """config.pbtxt for one model; `defaults` holds every request parameter's default value;
    `max_request_tokens` bounds prompts x beam_width x tokens_to_generate per request; the
    model server runs the model at TP `tensor` x PP `pipeline`."""
    inputs = [_tensor(TEXT_INPUT, "TYPE_STRING", [1], optional=False)]
    inputs += [
        _tensor(p.name, p.triton_type, [-1] if p.many else [1], optional=True) for p in PARAMETERS
    ]
    outputs = [
        _tensor(TEXT_OUTPUT, "TYPE_STRING", [1], optional=False),
        _tensor(FINISH_REASON, "TYPE_STRING", [1], optional=False),
    ]
    parts = [
        f"name: {_quote(name)}",
        'backend: "python"',
        f"max_batch_size: {max_batch_size}",
        "input [\n" + ",\n".join(inputs) + "\n]",
        "output [\n" + ",\n".join(outputs) + "\n]",
        # Thin clients of the model server (which holds the model and its GPUs): KIND_CPU.
        # A non-decoupled instance answers one batch at a time, so several instances let a
        # request arrive, and join the model server's running batch, while others generate;
        # the decoupled twin answers from threads and returns at once.
        f"instance_group [ {{ count: {1 if decoupled else PLAIN_INSTANCES}, kind: KIND_CPU }} ]",
    ]
    if decoupled:
        parts.append("model_transaction_policy { decoupled: true }")
    else:
        parts.append(
            f"dynamic_batching {{ max_queue_delay_microseconds: {max_queue_delay_microseconds} }}"
        )
    parts.append(_parameter("model_file", model_file))
    parts.append(_parameter(MAX_REQUEST_TOKENS, str(max_request_tokens)))
    parts.append(_parameter(TENSOR_PARALLEL, str(tensor)))
    parts.append(_parameter(PIPELINE_PARALLEL, str(pipeline)))
    for parameter in PARAMETERS:
        value = defaults[parameter.name]
        if parameter.many:
            value = list(value)
        parts.append(_parameter(f"default_{parameter.name}", json.dumps(value)))
    return "\n".join(parts) + "\n"


# Triton's stub imports the launcher from the checkout the export ran from when it is not
# installed in the server's Python (a container that mounts the checkout).
MODEL_PY = '''"""Triton Python-backend entry point written by the launcher's export stage."""

import sys

for path in {paths!r}:
    if path not in sys.path:
        sys.path.append(path)

from launcher_scripts.jobs.export.triton_model import TritonPythonModel  # noqa: E402,F401
'''


def write_repository(
    repository: Path,
    name: str,
    model_file: Path,
    *,
    max_batch_size: int,
    max_queue_delay_microseconds: int,
    defaults: Mapping[str, Any],
    max_request_tokens: int,
    launcher_path: str,
    tensor: int = 1,
    pipeline: int = 1,
) -> list[Path]:
    """Write both models into the (new, empty) folder `repository`. Returns the model
    directories; the served weights are `<first>/1/model.nemo`."""
    models = []
    for model, decoupled in ((name, False), (name + STREAM_SUFFIX, True)):
        version = repository / model / VERSION
        version.mkdir(parents=True)
        weights = f"{VERSION}/{MODEL_FILE}" if not decoupled else f"../{name}/1/{MODEL_FILE}"
        config = render_config(
            model,
            max_batch_size=max_batch_size,
            max_queue_delay_microseconds=max_queue_delay_microseconds,
            decoupled=decoupled,
            model_file=weights,
            defaults=defaults,
            max_request_tokens=max_request_tokens,
            tensor=tensor,
            pipeline=pipeline,
        )
        (repository / model / "config.pbtxt").write_text(config)
        (version / "model.py").write_text(MODEL_PY.format(paths=[launcher_path]))
        models.append(repository / model)
    _link_or_copy(model_file, repository / name / VERSION / MODEL_FILE)
    return models


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link when on one file system (no second copy of the weights), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
