"""The ensemble's `preprocessing` (text -> input_ids, input_lengths) and `postprocessing`
(output_ids, sequence_length -> text) models, as Triton's Python backend runs them.

Thin clients like the model's (triton_model.py): the model server holds the tokenizer, so
each batch of requests is one tokenize or detokenize request to it. Postprocessing decodes
each generated sequence after its prompt's ids when the ensemble passes them, so its text is
the text model's (SentencePiece drops a sequence's leading space when decoded alone).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from launcher_scripts.jobs.export.triton_model import (
    RequestError,
    as_text,
    cut_rows,
    error_response,
    padded_ids,
)
from launcher_scripts.jobs.inference.model_server import answer_lines
from launcher_scripts.recipes.triton_interface import (
    INPUT_IDS,
    INPUT_LENGTHS,
    MODEL_SERVER_VARIABLE,
    OUTPUT_IDS,
    PREPROCESSING,
    SEQUENCE_LENGTH,
    TEXT_INPUT,
    TEXT_OUTPUT,
)

try:  # present only inside Triton's Python backend
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported by tests and tools outside the server
    pb_utils = None


def tokenize_request(texts: Sequence[Any]) -> dict[str, Any]:
    return {"tokenize": [as_text(text) for text in texts]}


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        self.name = args["model_name"]
        self.tokenizes = self.name == PREPROCESSING
        self.server = os.environ.get(MODEL_SERVER_VARIABLE)
        if not self.server:
            raise RuntimeError(
                f"{self.name}: {MODEL_SERVER_VARIABLE} is not set: start the server with "
                "`python3 -m launcher_scripts serve EXPORT_DIR`, which starts the model server"
            )
        json.loads(args["model_config"])  # a malformed config fails here, at load

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                responses.append(self._answer(request))
            except RequestError as error:
                responses.append(error_response(str(error)))
            except OSError as error:  # the model server went away
                responses.append(error_response(f"the model server is not answering: {error}"))
        return responses

    def _input(self, request: Any, name: str) -> np.ndarray | None:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    def _answer(self, request: Any) -> Any:
        if self.tokenizes:
            texts = np.asarray(self._input(request, TEXT_INPUT)).reshape(-1)
            answer = self._ask(tokenize_request(texts))
            ids, lengths = padded_ids(answer["ids"])
            return pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor(INPUT_IDS, ids),
                    pb_utils.Tensor(INPUT_LENGTHS, lengths),
                ]
            )
        generated = cut_rows(
            self._input(request, OUTPUT_IDS), self._input(request, SEQUENCE_LENGTH),
            SEQUENCE_LENGTH, least=0,
        )  # fmt: skip
        prompt_ids = self._input(request, INPUT_IDS)
        prompts = [[] for _ in generated]
        if prompt_ids is not None:
            lengths = self._input(request, INPUT_LENGTHS)
            if lengths is None:
                lengths = np.full(len(prompt_ids), np.asarray(prompt_ids).shape[-1])
            prompts = cut_rows(prompt_ids, lengths, INPUT_LENGTHS, least=0)
        texts = self._ask({"detokenize": generated, "after": prompts})["texts"]
        as_bytes = np.array([[text.encode("utf-8")] for text in texts], dtype=object)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(TEXT_OUTPUT, as_bytes)])

    def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        answer = list(answer_lines(self.server, message))[-1]
        if "error" in answer:
            raise RequestError(answer["error"])
        return answer
