"""What the training loop asks of a model family's torch side.

A family's spec (launcher_scripts.families) names its runtime module; that module defines
`RUNTIME`, a ModelRuntime. The trainer builds the model, the datasets and each micro-batch's
forward pass and loss through it, and never asks which family it trains.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from launcher_scripts.families import ModelFamily
from launcher_scripts.jobs.training.runtime import JobError

# (batch, model) -> (output, loss function of the output): megatron-core's forward_step_func
# contract. The loss function returns (summed loss, counted tokens, {"lm loss": [sum, count]})
# when the config calculates per-token loss, else (mean loss, {"lm loss": [mean, 1]}); the
# trainer's reported loss is the sum over micro-batches and ranks over the count.
ForwardStep = Callable[[dict[str, Any], Any], tuple[Any, Callable[[Any], tuple[Any, Any, Any]]]]


@dataclass(frozen=True)
class ModelRuntime:
    # (cfg, use_te, on_gpu) -> megatron-core TransformerConfig (the encoder's, for T5)
    transformer_config: Callable[[Any, bool, bool], Any]
    # (cfg, config, vocab_size, use_te) -> this rank's model chunks
    build_chunks: Callable[[Any, Any, int, bool], list[Any]]
    # cfg -> what the datasets tokenize with (has vocab_size)
    data_tokenizer: Callable[[Any], Any]
    # (cfg, data tokenizer, (train, valid, test) samples, index cache) -> three datasets
    build_datasets: Callable[[Any, Any, tuple[int, int, int], Any], tuple[Any, Any, Any]]
    forward_step: ForwardStep
    # cfg -> (encoder or only sequence length, decoder sequence length or None): the shapes
    # pipeline stages exchange
    sequence_lengths: Callable[[Any], tuple[int, int | None]]
    batch_keys: tuple[str, ...]  # what a micro-batch holds


def runtime_of(family: ModelFamily) -> ModelRuntime:
    if family.runtime is None:
        raise JobError(
            f"model_family {family.name}: this launcher version has no training program for it"
        )
    runtime = importlib.import_module(family.runtime).RUNTIME
    assert isinstance(runtime, ModelRuntime), family.runtime
    return runtime


def token_loss(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple[Any, Any, Any]:
    """Summed token losses and the token count; megatron-core divides by the global count."""
    losses = output.float().reshape(-1)
    mask = loss_mask.reshape(-1).to(losses)
    loss = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.detach().to(loss)])}
