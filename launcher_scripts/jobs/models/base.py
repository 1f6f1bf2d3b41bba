"""What the job programs ask of a model family's torch side.

A family's spec (launcher_scripts.families) names its runtime module; that module defines
`RUNTIME`, a ModelRuntime. The trainer builds the model, the datasets and each micro-batch's
forward pass and loss through it, and never asks which family it trains; conversion and the
programs that load a portable file build the model and its Hugging Face export through it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from launcher_scripts.errors import (
    HfImportError,  # noqa: F401  (the job programs' name for it)
    JobError,
)
from launcher_scripts.families import ModelFamily


@dataclass
class HfModel:
    """A model as a Hugging Face transformers checkpoint."""

    config: dict[str, Any]  # config.json (the tokenizer's ids are added to it)
    state: dict[str, torch.Tensor]  # model.safetensors
    # The model's tokens past its tokenizer's own, in id order (T5's sentinels): the exported
    # tokenizer adds them so that its ids are the model's.
    added_tokens: tuple[str, ...] = ()


# (the model section training saved, its full tensors by megatron-core name) -> the checkpoint
# of the architecture the family's spec chose for it
HfExport = Callable[[Any, dict[str, torch.Tensor]], HfModel]

# (batch, model) -> (output, loss function of the output): megatron-core's forward_step_func
# contract. The loss function returns (summed loss, counted tokens, {"lm loss": [sum, count]})
# when the config calculates per-token loss, else (mean loss, {"lm loss": [mean, 1]}); the
# trainer's reported loss is the sum over micro-batches and ranks over the count.
ForwardStep = Callable[[dict[str, Any], Any], tuple[Any, Callable[[Any], tuple[Any, Any, Any]]]]


# (the tuning run's cfg, this rank's unwrapped chunks, their text tokenizer, parallelism,
# on_gpu, ids before every prompt) -> (a Decoding or logits_fn for generation, the tokenizer it
# encodes prompts and decodes answers with, the positions a prompt and its answer may take)
GenerationSetup = Callable[[Any, list[Any], Any, Any, bool, list[int]], tuple[Any, Any, int]]


@dataclass(frozen=True)
class TuningSide:
    """What fine-tuning asks of a family: how a prompt/answer record becomes a sample and
    how the model answers a prompt (validation's exact match, test predictions)."""

    # the model config's section -> the tokenizer of the records' text (encode, eod_id)
    text_tokenizer: Callable[[Any], Any]
    encode: Any  # sft_data.RecordEncoder: a record's tokens and loss mask
    # (cfg, tokenizer) -> sft_data.SampleMaker: a sample's model inputs (the batch_keys)
    sample_maker: Callable[[Any, Any], Any]
    generation: GenerationSetup
    chat: bool  # whether chat records ("conversations") can be tuned on
    peft_sites: Any  # peft.PeftSites: where the PEFT methods' modules go


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
    to_hf: HfExport | None = None  # None: no Hugging Face export
    # (model chunks, token count, ...) -> None: megatron-core's finalize_model_grads_func
    # contract; None: megatron-core's own. A family whose pipeline stages hold copies of a
    # table sums their gradients in it.
    finalize_grads: Callable[..., None] | None = None
    tuning: TuningSide | None = None  # None: no fine-tuning program for the family
    # runner.OpenedModel -> served.ServedModel: text generation for serving; None: not served
    served: Callable[[Any], Any] | None = None


def runtime_of(family: ModelFamily) -> ModelRuntime:
    """The family's torch side (imports megatron-core)."""
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
