"""The Triton model repository the export stage writes:

    <model_repository>/
      <model_name>/config.pbtxt          Python backend, dynamic batching
      <model_name>/1/model.py            imports the launcher's Triton model
      <model_name>/1/model.nemo          the portable checkpoint being served
      <model_name>_stream/config.pbtxt   the same model, decoupled: streams text as it is made
      <model_name>_tokens/config.pbtxt   the same model on token ids: input_ids -> output_ids
      preprocessing/config.pbtxt         text -> input_ids (the model's tokenizer)
      postprocessing/config.pbtxt        output_ids -> text
      ensemble/config.pbtxt              preprocessing -> <model_name>_tokens -> postprocessing
      */1/model.py                       each imports its class from the launcher

A streaming twin because Triton answers plain (HTTP or gRPC) inference only from non-decoupled
models and streams only from decoupled ones; the ensemble is the reference's (section 6.2), for
clients that send text or token ids to one pipeline. Every model is a thin client of one model
server, which `serve` starts on the first one's weights file (jobs/inference/model_server.py);
the tokenizer lives there too, so Triton's Python needs none of the tokenizer's packages.

Rendering is pure (`render_config`); `write_repository` fills a folder, which the export job
builds beside the repository, checks, and swaps in whole only when the check passed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from launcher_scripts.recipes.triton_interface import (
    ENSEMBLE,
    FINISH_REASON,
    INPUT_IDS,
    INPUT_LENGTHS,
    MAX_REQUEST_TOKENS,
    OUTPUT_IDS,
    PARAMETERS,
    PIPELINE_PARALLEL,
    POSTPROCESSING,
    PREPROCESSING,
    SEQUENCE_LENGTH,
    STREAM_SUFFIX,
    TENSOR_PARALLEL,
    TEXT_INPUT,
    TEXT_OUTPUT,
    TOKENS_SUFFIX,
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


def _parameter_inputs() -> list[str]:
    """The generation parameters, each an optional input (the export's default when absent)."""
    return [
        _tensor(p.name, p.triton_type, [-1] if p.many else [1], optional=True) for p in PARAMETERS
    ]


def _head(
    name: str, runs_on: str, max_batch_size: int, inputs: list[str], outputs: list[str]
) -> list[str]:
    """A config's first lines: its name, what runs it (a backend or the ensemble platform), its
    batch size and its tensors."""
    return [
        f"name: {_quote(name)}",
        runs_on,
        f"max_batch_size: {max_batch_size}",
        "input [\n" + ",\n".join(inputs) + "\n]",
        "output [\n" + ",\n".join(outputs) + "\n]",
    ]


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
    on_ids: bool = False,
) -> str:
    """config.pbtxt for one model; `defaults` holds every request parameter's default value;
    `max_request_tokens` bounds prompts x beam_width x tokens_to_generate per request; the
    model server runs the model at TP `tensor` x PP `pipeline`. `on_ids`: the model takes
    and returns token ids (the ensemble's middle step), not text."""
    if on_ids:
        inputs = [
            _tensor(INPUT_IDS, "TYPE_INT32", [-1], optional=False),
            _tensor(INPUT_LENGTHS, "TYPE_INT32", [1], optional=True),
        ]
        outputs = [
            _tensor(OUTPUT_IDS, "TYPE_INT32", [-1], optional=False),
            _tensor(SEQUENCE_LENGTH, "TYPE_INT32", [1], optional=False),
        ]
    else:
        inputs = [_tensor(TEXT_INPUT, "TYPE_STRING", [1], optional=False)]
        outputs = [_tensor(TEXT_OUTPUT, "TYPE_STRING", [1], optional=False)]
    inputs += _parameter_inputs()
    outputs.append(_tensor(FINISH_REASON, "TYPE_STRING", [1], optional=False))
    parts = [
        *_head(name, 'backend: "python"', max_batch_size, inputs, outputs),
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


def render_tokenizer_config(name: str, *, max_batch_size: int) -> str:
    """config.pbtxt of `preprocessing` (text -> ids) or `postprocessing` (ids -> text); the
    postprocessing decodes each sequence after its prompt's ids, as the text model does."""
    if name == PREPROCESSING:
        inputs = [_tensor(TEXT_INPUT, "TYPE_STRING", [1], optional=False)]
        outputs = [
            _tensor(INPUT_IDS, "TYPE_INT32", [-1], optional=False),
            _tensor(INPUT_LENGTHS, "TYPE_INT32", [1], optional=False),
        ]
    else:
        inputs = [
            _tensor(OUTPUT_IDS, "TYPE_INT32", [-1], optional=False),
            _tensor(SEQUENCE_LENGTH, "TYPE_INT32", [1], optional=False),
            _tensor(INPUT_IDS, "TYPE_INT32", [-1], optional=True),
            _tensor(INPUT_LENGTHS, "TYPE_INT32", [1], optional=True),
        ]
        outputs = [_tensor(TEXT_OUTPUT, "TYPE_STRING", [1], optional=False)]
    parts = [
        *_head(name, 'backend: "python"', max_batch_size, inputs, outputs),
        # One instance: a batch is one quick tokenizer call, and each instance is a process.
        "instance_group [ { count: 1, kind: KIND_CPU } ]",
        "dynamic_batching { }",
    ]
    return "\n".join(parts) + "\n"


def _step(model: str, inputs: Mapping[str, str], outputs: Mapping[str, str]) -> str:
    maps = [f"      input_map {{ key: {_quote(k)} value: {_quote(v)} }}" for k, v in inputs.items()]
    maps += [
        f"      output_map {{ key: {_quote(k)} value: {_quote(v)} }}" for k, v in outputs.items()
    ]
    head = f"    {{\n      model_name: {_quote(model)}\n      model_version: -1\n"
    return head + "\n".join(maps) + "\n    }"


def render_ensemble_config(model: str, *, max_batch_size: int) -> str:
    """config.pbtxt of `ensemble`: text (and the request parameters) in, text and the
    generated ids out; `model` is the model on ids it runs between the tokenizer's steps."""
    inputs = [_tensor(TEXT_INPUT, "TYPE_STRING", [1], optional=False), *_parameter_inputs()]
    outputs = [
        _tensor(TEXT_OUTPUT, "TYPE_STRING", [1], optional=False),
        _tensor(FINISH_REASON, "TYPE_STRING", [1], optional=False),
        _tensor(OUTPUT_IDS, "TYPE_INT32", [-1], optional=False),
        _tensor(SEQUENCE_LENGTH, "TYPE_INT32", [1], optional=False),
    ]
    prompt = {INPUT_IDS: "prompt_ids", INPUT_LENGTHS: "prompt_lengths"}
    steps = [
        _step(PREPROCESSING, {TEXT_INPUT: TEXT_INPUT}, prompt),
        _step(
            model,
            {**prompt, **{p.name: p.name for p in PARAMETERS}},
            {name: name for name in (OUTPUT_IDS, SEQUENCE_LENGTH, FINISH_REASON)},
        ),
        _step(
            POSTPROCESSING,
            {OUTPUT_IDS: OUTPUT_IDS, SEQUENCE_LENGTH: SEQUENCE_LENGTH, **prompt},
            {TEXT_OUTPUT: TEXT_OUTPUT},
        ),
    ]
    parts = [
        *_head(ENSEMBLE, 'platform: "ensemble"', max_batch_size, inputs, outputs),
        "ensemble_scheduling {\n  step [\n" + ",\n".join(steps) + "\n  ]\n}",
    ]
    return "\n".join(parts) + "\n"


# Triton's stub imports the launcher from the checkout the export ran from when it is not
# installed in the server's Python (a container that mounts the checkout).
MODEL_PY = '''"""Triton Python-backend entry point written by the launcher's export stage."""

import sys

for path in {paths!r}:
    if path not in sys.path:
        sys.path.append(path)

from launcher_scripts.jobs.export.{module} import TritonPythonModel  # noqa: E402,F401
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
    """Write every model into the (new, empty) folder `repository`. Returns the model
    directories; the served weights are `<first>/1/model.nemo`."""
    configs = {}
    for model, decoupled, on_ids in (
        (name, False, False),
        (name + STREAM_SUFFIX, True, False),
        (name + TOKENS_SUFFIX, False, True),
    ):
        configs[model] = render_config(
            model,
            max_batch_size=max_batch_size,
            max_queue_delay_microseconds=max_queue_delay_microseconds,
            decoupled=decoupled,
            model_file=f"{VERSION}/{MODEL_FILE}" if model == name else f"../{name}/1/{MODEL_FILE}",
            defaults=defaults,
            max_request_tokens=max_request_tokens,
            tensor=tensor,
            pipeline=pipeline,
            on_ids=on_ids,
        )
    for step in (PREPROCESSING, POSTPROCESSING):
        configs[step] = render_tokenizer_config(step, max_batch_size=max_batch_size)
    configs[ENSEMBLE] = render_ensemble_config(name + TOKENS_SUFFIX, max_batch_size=max_batch_size)
    models = []
    for model, config in configs.items():
        version = repository / model / VERSION
        version.mkdir(parents=True)
        (repository / model / "config.pbtxt").write_text(config)
        if model != ENSEMBLE:
            tokenizer = model in (PREPROCESSING, POSTPROCESSING)
            module = "triton_tokenizer" if tokenizer else "triton_model"
            (version / "model.py").write_text(MODEL_PY.format(paths=[launcher_path], module=module))
        models.append(repository / model)
    _link_or_copy(model_file, repository / name / VERSION / MODEL_FILE)
    return models


def config_inputs(config: str) -> dict[str, str]:
    """A config.pbtxt's inputs, name -> the datatype a client sends (BYTES for TYPE_STRING),
    in order: what the HTTP front checks a request to that model against."""
    block = re.search(r"^input \[(.*?)^\]", config, re.MULTILINE | re.DOTALL)
    if block is None:
        return {}
    pairs = re.findall(r'name:\s*"([^"]+)"\s*data_type:\s*TYPE_(\w+)', block.group(1))
    return {name: "BYTES" if kind == "STRING" else kind for name, kind in pairs}


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link when on one file system (no second copy of the weights), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
