"""The recipe of an evaluation of a tuned model (`evaluation_kind: fine_tuned`): the keys it
may set and the model files it names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PEFT_KEYS = ("peft_model_file", "adapter_model_file", "virtual_prompt_model_file")
# Keys this program reads with a default that an evaluation recipe may leave out (the
# preflight's key check knows them from here); the PEFT_KEYS belong to their recipes' method.
OPTIONAL_KEYS = (
    "model.restore_from_path",
    "model.language_model_path",
    "model.disable_special_tokens",
    "model.eval_batch_size",
    "data.prompt_template",
    "data.context_key",
    "data.label_key",
    "data.max_seq_length",
    "data.pred_file_path",
    "inference.greedy",
    "inference.top_k",
    "inference.top_p",
    "inference.temperature",
    "inference.repetition_penalty",
)


def peft_file_of(model: Any) -> Path | None:
    for key in PEFT_KEYS:
        if model.get(key):
            return Path(str(model[key]))
    return None


def model_file_of(model: Any) -> Path:
    return Path(str(model.get("restore_from_path") or model.language_model_path))
