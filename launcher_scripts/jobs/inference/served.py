"""A portable file's model as a server (Triton's model, the export's check, benchmarks) uses it,
whatever its family: text in, text out through the shared generation engine.

The family's runtime (`ModelRuntime.served`) says how its model answers: a decoder stack
continues the prompt in place, through its KV cache (kv_cache.py); an encoder-decoder reads the
prompt with its encoder and writes the answer with its decoder (seq2seq.py, no cache yet). Both
give `generation.generate` the same thing: a `Decoding` and a tokenizer whose `encode` makes a
prompt's row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher_scripts.jobs.inference.memory import ForwardShape


@dataclass
class ServedModel:
    decoding: Any  # generation.Decoding: what generate and stream continue prompts with
    tokenizer: Any  # generation.Tokenizer: encode gives a prompt's whole row
    max_length: int  # what generate may check a row's prompt + answer against
    shape: ForwardShape  # what a forward pass over rows x width allocates (memory.py)
    on_gpu: bool
    # (a prompt's row length, tokens_to_generate) -> why the model cannot take it, or None
    too_long: Callable[[int, int], str | None]


def open_served(
    model_file: Path, tensor: int = 1, pipeline: int = 1, on_gpu: bool | None = None
) -> ServedModel:
    """Build the file's model on this rank (every rank of a TP x PP group calls this) and wrap
    it for generation. `runner.close_runner()` ends it."""
    from launcher_scripts.families import family_of
    from launcher_scripts.jobs.inference.runner import InferenceError, open_model
    from launcher_scripts.jobs.models.base import runtime_of
    from launcher_scripts.jobs.training.runtime import JobError

    opened = open_model(model_file, tensor, pipeline, on_gpu)
    try:
        runtime = runtime_of(family_of(opened.config, "model"))
    except (JobError, ValueError) as error:
        raise InferenceError(str(error)) from None
    if runtime.served is None:
        raise InferenceError(f"{model_file}: this version cannot serve its model's family")
    return runtime.served(opened)


def forward_shape(chunk: Any, tensor: int, vocab_size: int, on_gpu: bool) -> ForwardShape:
    """The shape memory.py estimates one rank's forward pass from, read off a built chunk."""
    config = chunk.config
    return ForwardShape(
        hidden=int(config.hidden_size),
        ffn_hidden=int(config.ffn_hidden_size) // tensor,
        heads=int(config.num_attention_heads) // tensor,
        gated=bool(config.gated_linear_unit),
        padded_vocab=int(chunk.vocab_size),
        vocab=vocab_size,
        dtype_bytes=next(chunk.parameters()).dtype.itemsize,
        on_gpu=on_gpu,
    )
