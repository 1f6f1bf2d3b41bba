"""The recipe of an evaluation of a tuned model (`evaluation_kind: fine_tuned`): the keys it
may set, the model files it names and its test files (JSON lines under `data.test_ds`, or
text-to-text pairs under `data.src_file_name` / `tgt_file_name`, T5's layout)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher_scripts.errors import RecipeError
from launcher_scripts.recipes.tuning import file_list, text_pairs

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
    "data.max_src_seq_length",
    "data.max_tgt_seq_length",
    "data.names",
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


@dataclass(frozen=True)
class TestFiles:
    sources: tuple[Path, ...]  # JSON-lines files, or the inputs of text-to-text pairs
    targets: tuple[Path, ...]  # the pairs' answers (empty: JSON lines)
    names: tuple[str, ...]  # one per file: its scores' name

    def inputs(self) -> list[tuple[str, Path]]:
        """(recipe key, path) of every file."""
        if not self.targets:
            return [(f"data.test_ds[{i}]", path) for i, path in enumerate(self.sources)]
        return [(f"data.src_file_name[{i}]", p) for i, p in enumerate(self.sources)] + [
            (f"data.tgt_file_name[{i}]", p) for i, p in enumerate(self.targets)
        ]


def test_files(data: Any, stage: str = "evaluation") -> TestFiles:
    if data.get("src_file_name") is not None:
        sources, targets = text_pairs(data, f"{stage}.data")
    else:
        sources, targets = file_list(f"{stage}.data.test_ds", data.get("test_ds")), ()
    names = data.get("names")
    if names is None:
        return TestFiles(sources, targets, tuple(path.stem for path in sources))
    if len(names) != len(sources):
        raise RecipeError(
            f"{stage}.data.names: {len(names)} names for {len(sources)} test files: give one "
            "per file, or null"
        )
    return TestFiles(sources, targets, tuple(str(name) for name in names))
