"""What every Hugging Face import checks of a checkpoint directory before it reads a weight:
that config.json, the tensors and the tokenizer describe one model. transformers itself refuses
to load a checkpoint whose tensors disagree with its config; an import that took it would build
another model (a tied output layer for a missing one), or fail later with a traceback (a
tokenizer id past the embedding's rows).

Torch-free: the conversion stage's preflight asks the families' checks (ModelFamily
.hf_import_check), and the import job asks them again. A disagreement is one line naming the
config.json field, the tensor and both values.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher_scripts.errors import HfImportError
from launcher_scripts.formats.safetensors_stream import TensorSource


@dataclass(frozen=True)
class Dimension:
    """One of a tensor's sizes that a config.json field sets."""

    field: str  # config.json's name, as the message gives it
    value: int  # what config.json says (or what its fields make)
    tensor: str  # the checkpoint's name
    axis: int


def check_dimensions(source: TensorSource, dimensions: Iterable[Dimension]) -> None:
    """Each tensor named has the size its config.json field gives (a tensor the checkpoint
    lacks is left to the import, which names it)."""
    for dim in dimensions:
        if dim.tensor not in source:
            continue
        shape = source.shape(dim.tensor)
        actual = shape[dim.axis] if dim.axis < len(shape) else None
        if actual != dim.value:
            raise HfImportError(
                f"config.json {dim.field} is {dim.value}, but {dim.tensor} has "
                f"{actual} {_axis_name(dim.axis, len(shape))} (shape {list(shape)}): the config "
                "and the weights are of different models; save them together (save_pretrained)"
            )


def _axis_name(axis: int, rank: int) -> str:
    if rank == 1:
        return "values"
    return "rows" if axis == 0 else "columns"


def check_layer_count(source: TensorSource, prefix: str, field: str, layers: int) -> None:
    """The checkpoint holds layers 0..layers-1 under `prefix` ("model.layers."), no more:
    layers past config.json's count would be dropped without a word."""
    held = {
        int(name[len(prefix) :].split(".", 1)[0])
        for name in source.names
        if name.startswith(prefix) and name[len(prefix) :].split(".", 1)[0].isdigit()
    }
    if held and max(held) + 1 != layers:
        raise HfImportError(
            f"config.json {field} is {layers}, but the checkpoint has {max(held) + 1} layers "
            f"({prefix}0 to {prefix}{max(held)}): the config and the weights are of different "
            "models; save them together (save_pretrained)"
        )


def check_output_layer(config: dict[str, Any], source: TensorSource, output: str) -> None:
    """An untied model (tie_word_embeddings false) has its own output layer: without it the
    import would take the embedding table for it, another model."""
    tied = config.get("tie_word_embeddings", True)
    if tied is False and output not in source:
        raise HfImportError(
            f"config.json tie_word_embeddings is false, but the checkpoint has no {output} "
            "(its output layer): the weights are incomplete; save the model again "
            "(save_pretrained), or set tie_word_embeddings to true if the output layer is the "
            "embedding table"
        )


def tokenizer_size(path: Path, merges: Path | None = None) -> int:
    """One more than the largest id of a tokenizer's file: tokenizer.json, a SentencePiece
    .model, or GPT-2's vocab.json (with its merges.txt); HfImportError naming the file when
    it is not one."""
    with reading_tokenizer(path):
        if path.suffix == ".json" and merges is not None:
            return _gpt2_size(path, merges)
        if path.suffix == ".json":
            import tokenizers

            table = tokenizers.Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
            return max(table.values(), default=-1) + 1
        import sentencepiece

        processor = sentencepiece.SentencePieceProcessor()
        processor.Load(str(path))
        return int(processor.get_piece_size())


@contextmanager
def reading_tokenizer(path: Path) -> Iterator[None]:
    """Whatever loading the tokenizer file `path` raises, as one HfImportError naming it."""
    try:
        yield
    except HfImportError:
        raise
    except Exception as error:  # the Rust and C++ loaders raise plain Exception subclasses
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise HfImportError(
            f"{path} is not a readable tokenizer ({reason}): save the model's tokenizer again "
            "(tokenizer.save_pretrained)"
        ) from None


def _gpt2_size(vocab: Path, merges: Path) -> int:
    from launcher_scripts.formats.tokenizer import TokenizerError, gpt2_reference

    try:
        gpt2_reference(str(vocab), str(merges))
    except TokenizerError as error:
        raise HfImportError(str(error)) from None
    table = json.loads(vocab.read_text(encoding="utf-8"))
    return max((int(i) for i in table.values()), default=-1) + 1


def check_tokenizer(path: Path, size: int, source: TensorSource, embedding: str) -> None:
    """Every id of the tokenizer has a row of the embedding table."""
    rows = source.shape(embedding)[0]
    if size > rows:
        raise HfImportError(
            f"{path} has {size} tokens, more than the {rows} rows of {embedding} (config.json "
            f"vocab_size): ids {rows} and up have no embedding; use the tokenizer saved with "
            "this model"
        )
