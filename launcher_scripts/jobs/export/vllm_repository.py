"""The Triton repository for the vLLM backend the export writes when `export.vllm.enabled`:

    <model_repository>/<model_name>/config.pbtxt    backend "vllm", decoupled, one instance
    <model_repository>/<model_name>/1/model.json    vLLM's engine arguments

vLLM serves the Hugging Face directory the conversion stage writes (paged attention on GPUs).
Triton's vllm backend completes the inputs and outputs itself (text_input, stream,
sampling_parameters, exclude_input_in_output; text_output). Rendering is pure; the keys of
model.json are vLLM's AsyncEngineArgs fields, checked against ENGINE_ARGS so a misspelled one
fails here and not when a GPU server starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# vLLM's engine arguments the launcher sets (vllm.engine.arg_utils.AsyncEngineArgs fields).
ENGINE_ARGS = frozenset(
    {
        "model",
        "tokenizer",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "gpu_memory_utilization",
        "max_model_len",
        "dtype",
        "enforce_eager",
        "disable_log_stats",
    }
)


def engine_args(
    hf_dir: Path, tensor: int, pipeline: int, settings: dict[str, Any]
) -> dict[str, Any]:
    args: dict[str, Any] = {
        "model": str(hf_dir),
        "tokenizer": str(hf_dir),
        "tensor_parallel_size": tensor,
        "pipeline_parallel_size": pipeline,
        "gpu_memory_utilization": float(settings["gpu_memory_utilization"]),
        "dtype": str(settings["dtype"]),
        "disable_log_stats": True,
    }
    if settings.get("max_model_len") is not None:
        args["max_model_len"] = int(settings["max_model_len"])
    unknown = sorted(set(args) - ENGINE_ARGS)
    if unknown:
        raise ValueError(f"not vLLM engine arguments: {unknown}")
    return args


def render_config(name: str) -> str:
    return (
        "\n".join(
            [
                f"name: {json.dumps(name)}",
                'backend: "vllm"',
                # vLLM places the model on its GPUs itself.
                "instance_group [ { count: 1, kind: KIND_MODEL } ]",
                "model_transaction_policy { decoupled: true }",
            ]
        )
        + "\n"
    )


def write_vllm_repository(repository: Path, name: str, args: dict[str, Any]) -> Path:
    """Fill the (new, empty) folder `repository`; returns the model's directory."""
    model = repository / name
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(render_config(name))
    (model / "1" / "model.json").write_text(json.dumps(args, indent=2) + "\n")
    return model
