"""The served model's request interface, defined once: config.pbtxt is rendered from it and the
Triton model parses requests with it. Torch-free, so the stage and the renderer can import it.

Parameter names are the recipe's `export.generation` keys (NeMo's inference guide names).
Every input but `text_input` is optional; a missing one takes the export's default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

TEXT_INPUT = "text_input"
TEXT_OUTPUT = "text_output"
FINISH_REASON = "finish_reason"
STREAM_SUFFIX = "_stream"  # the decoupled (streaming) twin of a served model
# The ensemble (the reference's section 6.2): text -> preprocessing -> the model on token ids
# (TOKENS_SUFFIX) -> postprocessing -> text. Rows of ids are padded with PAD_ID after their
# length.
TOKENS_SUFFIX = "_tokens"
PREPROCESSING = "preprocessing"
POSTPROCESSING = "postprocessing"
ENSEMBLE = "ensemble"
INPUT_IDS = "input_ids"
INPUT_LENGTHS = "input_lengths"
OUTPUT_IDS = "output_ids"
SEQUENCE_LENGTH = "sequence_length"
PAD_ID = -1


@dataclass(frozen=True)
class RequestParameter:
    name: str  # input name == GenerationParams field == export.generation key
    triton_type: str  # config.pbtxt data type
    numpy_type: str  # what the client sends (tritonclient datatype names differ: see client_type)
    client_type: str
    many: bool = False  # a list per request (stop_words), else one value


PARAMETERS: tuple[RequestParameter, ...] = (
    RequestParameter("tokens_to_generate", "TYPE_INT32", "int32", "INT32"),
    RequestParameter("temperature", "TYPE_FP32", "float32", "FP32"),
    RequestParameter("top_k", "TYPE_INT32", "int32", "INT32"),
    RequestParameter("top_p", "TYPE_FP32", "float32", "FP32"),
    RequestParameter("repetition_penalty", "TYPE_FP32", "float32", "FP32"),
    RequestParameter("random_seed", "TYPE_UINT64", "uint64", "UINT64"),
    RequestParameter("stop_words", "TYPE_STRING", "object", "BYTES", many=True),
    RequestParameter("beam_width", "TYPE_INT32", "int32", "INT32"),
    RequestParameter("length_penalty", "TYPE_FP32", "float32", "FP32"),
    RequestParameter("beam_search_diversity_rate", "TYPE_FP32", "float32", "FP32"),
)
PARAMETER_NAMES = tuple(p.name for p in PARAMETERS)

# Dropping the work of a client that went away: `serve`'s HTTP front gives each request an id
# in this header (Triton passes it to the model as a request parameter), and when the client
# disconnects before its answer, creates a file of that name in the folder this environment
# variable names; the model stops generating for a request whose file exists.
REQUEST_ID_HEADER = "launcher-request-id"
CANCELLED_REQUESTS_VARIABLE = "LLM_LAUNCHER_CANCELLED_REQUESTS"
# The model server's socket (jobs/inference/model_server.py), for Triton's models to reach it.
MODEL_SERVER_VARIABLE = "LLM_LAUNCHER_MODEL_SERVER"
# In that folder: the server is stopping, every request is cancelled (gRPC ones included).
ALL_CANCELLED = "all-requests"
# What the config.pbtxt parameter of the limit on a request's generated tokens is called.
MAX_REQUEST_TOKENS = "max_request_tokens"
# export.vllm.dtype: the dtypes vLLM's engine takes.
VLLM_DTYPES = ("auto", "bfloat16", "float16", "float32")
# The layout the model server runs the model at (config.pbtxt parameters the export writes).
TENSOR_PARALLEL = "tensor_model_parallel_size"
PIPELINE_PARALLEL = "pipeline_model_parallel_size"


def generation_defaults(cfg: DictConfig) -> dict[str, Any]:
    section = OmegaConf.to_container(cfg.generation, resolve=True)
    assert isinstance(section, dict)
    values = {name: section[name] for name in PARAMETER_NAMES}
    values["stop_words"] = tuple(values["stop_words"] or ())
    return values
