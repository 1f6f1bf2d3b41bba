"""Parameter-efficient tuning modules added to a built megatron-core model: what every method
shares (each method's modules are one module of jobs/fine_tuning/methods/, named by its
registration in launcher_scripts/tuning/).

The base modules are not replaced: each method attaches small modules beside them and changes
their outputs with forward hooks, so the base weights keep their names (a portable checkpoint
loads unchanged) and stay frozen. Every added module works under tensor parallelism the way the
linear it modifies does, using megatron-core's autograd-aware collectives:

  LoRA on a column-parallel linear (qkv, fc1):  delta = B_shard(copy(A x))
  LoRA on a row-parallel linear (proj, fc2):    delta = B(reduce(A_shard x_shard))
  adapter after attention and after the MLP:     out + W_out(act(W_in(norm(out)))), W_in
                                                 column- and W_out row-parallel
  IA3:                                           keys, values and FFN activations scaled by
                                                 learned vectors, sharded like those features
  prompt tuning / P-tuning:                      the first `virtual_tokens` input embeddings
                                                 replaced by learned ones (P-tuning: produced
                                                 by an MLP from learned inputs)

Parameters that each TP rank computes on its own slice of the sequence (sequence parallelism)
are marked `sequence_parallel`, so megatron-core all-reduces their gradients over TP like the
layer norms'. Every added parameter has a checkpoint key `peft.<...>` and a global shape that do
not depend on the layout, and is initialised from a generator seeded by that key, so a run at
TP=2 starts from the same adapters as one at TP=1.
"""

from __future__ import annotations

import importlib
import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core import tensor_parallel as tp
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.utils import (
    make_sharded_tensor_for_checkpoint,
    make_tp_sharded_tensor_for_checkpoint,
)

from launcher_scripts.tuning import METHODS, PeftSettings

PEFT_SEGMENT = "peft."  # in every checkpoint key of an added tensor


class MergeError(ValueError):
    """A PEFT file that cannot be folded into this base model, as one line for the user."""


# ---------------------------------------------------------------------------------------------
# Sharded parameters


class PeftModule(torch.nn.Module):
    """A module whose parameters carry layout-independent checkpoint keys."""

    def __init__(self, key: str, sequence_parallel: bool) -> None:
        super().__init__()
        self.key = key  # e.g. "3.attention_qkv": layer 3's LoRA on qkv
        self.child_name = ""  # its attribute name in the owning module, set when attached
        self.sequence_parallel = sequence_parallel
        self.axes: dict[str, int | None] = {}  # the TP-split axis of each, or None: whole
        self.inits: dict[str, str] = {}
        # Split by rows like a gated fc1: each rank holds its share of the gate's rows and of
        # the linear half's, so the full tensor is [gate; linear] whatever the layout.
        self.gated_rows: set[str] = set()

    def add(self, name: str, local_shape: tuple[int, ...], init: str, axis: int | None) -> None:
        param = torch.nn.Parameter(torch.zeros(local_shape))
        if axis is None:
            # Replicated over TP; under sequence parallelism each rank sees other tokens.
            param.sequence_parallel = self.sequence_parallel  # type: ignore[attr-defined]
        else:
            tp.set_tensor_model_parallel_attributes(param, True, axis, 1)
        self.register_parameter(name, param)
        self.axes[name] = axis
        self.inits[name] = init

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        # The key names the layer itself, so the layer-stacking offsets are not used; it must
        # still start with the owner's prefix, which megatron-core rewrites for layers.
        del sharded_offsets, metadata
        owner = prefix.removesuffix(f"{self.child_name}.")
        result: dict[str, Any] = {}
        for name, param in self.named_parameters(recurse=False):
            key = f"{owner}{PEFT_SEGMENT}{self.key}.{name}"
            axis = self.axes[name]
            if axis is None:
                sharded = make_sharded_tensor_for_checkpoint(param, key)
            else:
                sharded = make_tp_sharded_tensor_for_checkpoint(param, key, tp_axis=axis)
            if name in self.gated_rows:
                sharded = apply_swiglu_sharded_factory(sharded, ())
            result[f"{prefix}{name}"] = sharded
        return result


def initial_value(key: str, shape: tuple[int, ...], init: str, seed: int, std: float) -> Any:
    if init == "zero":
        return torch.zeros(shape)
    if init == "ones":
        return torch.ones(shape)
    generator = torch.Generator()
    generator.manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63)
    if init == "xavier":
        fan_out, fan_in = shape[0], math.prod(shape[1:]) if len(shape) > 1 else 1
        bound = math.sqrt(6.0 / (fan_in + fan_out))
        return torch.empty(shape).uniform_(-bound, bound, generator=generator)
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def tp_size() -> int:
    return parallel_state.get_tensor_model_parallel_world_size()


# ---------------------------------------------------------------------------------------------
# Attaching to a model


@dataclass
class Attached:
    modules: list[PeftModule]
    handles: list[Any]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@dataclass(frozen=True)
class PeftSites:
    """Where a family's model takes the added modules."""

    # chunk -> (key prefix, transformer layer) of every layer the methods adapt; the prefix
    # keeps the keys of two stacks apart (T5's "encoder." and "decoder.")
    layers: Callable[[Any], list[tuple[str, Any]]]
    # chunk -> (module, whether its hidden_states argument (rather than its output) holds the
    # embedded sequence that virtual tokens start), or None: no prompt on this chunk
    prompt: Callable[[Any], tuple[Any, bool] | None]


def _decoder_layers(chunk: Any) -> list[tuple[str, Any]]:
    decoder = getattr(chunk, "decoder", None)
    return [("", layer) for layer in decoder.layers] if decoder is not None else []


# A decoder stack (GPT): its layers, numbered as they are; the prompt in the embedding's output.
DECODER_STACK = PeftSites(
    layers=_decoder_layers,
    prompt=lambda chunk: (chunk.embedding, False) if getattr(chunk, "pre_process", False) else None,
)


class Attaching:
    """What a method's `attach` adds to a model: each module becomes a child of its owner
    (so its parameters are the model's, under a key of their own) and hooks the module whose
    output (or input) it changes."""

    def __init__(self, sequence_parallel: bool) -> None:
        self.sequence_parallel = sequence_parallel
        self.modules: list[PeftModule] = []
        self.handles: list[Any] = []

    def add(
        self,
        owner: Any,
        name: str,
        added: PeftModule,
        site: Any,
        hook: Callable[..., Any],
        pre: bool = False,
        with_kwargs: bool = False,
    ) -> None:
        added.child_name = name
        owner.add_module(name, added)
        self.modules.append(added)
        register = site.register_forward_pre_hook if pre else site.register_forward_hook
        self.handles.append(register(hook, with_kwargs=with_kwargs))


def chosen_layers(
    chunk: Any, sites: PeftSites, settings: PeftSettings
) -> Iterator[tuple[str, Any]]:
    """(key base, layer) of each layer of the chunk the settings choose: the base names the
    layer in its added tensors' keys (`[<stack>.]<layer number>`)."""
    for prefix, layer in sites.layers(chunk):
        number = int(layer.layer_number)
        if settings.chosen(number):
            yield f"{prefix}{number}", layer


def attach(
    chunks: list[Any], settings: PeftSettings, config: Any, sites: PeftSites = DECODER_STACK
) -> Attached:
    """Add the method's modules to every chunk (before any DDP or fp16 wrapping). Each layer's
    modules follow its own config (an encoder's and a decoder's may differ)."""
    method = importlib.import_module(settings.method.runtime)
    attaching = Attaching(bool(config.sequence_parallel))
    for chunk in chunks:
        method.attach(chunk, sites, settings, config, attaching)
    return Attached(attaching.modules, attaching.handles)


def freeze_base(chunks: list[Any], keep: Callable[[str], bool] | None = None) -> None:
    """Only the added modules learn, and the parameters whose names `keep` accepts."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            param.requires_grad = is_peft_parameter(name) or (keep is not None and keep(name))


# The attribute names every method's added modules start with (freeze_base asks per parameter).
_PREFIXES = tuple(sorted({prefix for method in METHODS.values() for prefix in method.prefixes}))


def is_peft_parameter(name: str) -> bool:
    return any(part.startswith(_PREFIXES) for part in name.split(".")[:-1])


def initial_values(attached: Attached, seed: int, std: float) -> Callable[[Any], torch.Tensor]:
    """For init_weights.assign_global: the layout-independent start of each added tensor."""
    inits = {f"{m.key}.{name}": init for m in attached.modules for name, init in m.inits.items()}

    def value(tensor: Any) -> torch.Tensor:
        init = inits[tensor.key.split(PEFT_SEGMENT, 1)[1]]
        return initial_value(tensor.key, tuple(tensor.global_shape), init, seed, std)

    return value


def is_peft_key(key: str) -> bool:
    return key.startswith(PEFT_SEGMENT) or f".{PEFT_SEGMENT}" in key
