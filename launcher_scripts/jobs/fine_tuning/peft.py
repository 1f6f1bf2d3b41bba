"""Parameter-efficient tuning modules added to a built megatron-core GPT model.

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

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core import tensor_parallel as tp
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.utils import (
    make_sharded_tensor_for_checkpoint,
    make_tp_sharded_tensor_for_checkpoint,
)

from launcher_scripts.errors import RecipeError
from launcher_scripts.recipes.tuning import LORA_LINEARS, PeftSettings

# target name -> (submodule of the layer, linear, parallel style)
# target -> (module, linear, how megatron-core splits the linear over TP). Layers without a
# cross-attention (GPT's, an encoder's) have none of the cross_attention_* linears.
LORA_TARGETS = {
    target: (owner, linear, "row" if linear in ("linear_proj", "linear_fc2") else "column")
    for target, (owner, linear) in LORA_LINEARS.items()
}
PEFT_SEGMENT = "peft."  # in every checkpoint key of an added tensor
ADAPTER_ACTIVATIONS = {"swish": F.silu, "silu": F.silu, "gelu": F.gelu, "relu": F.relu}


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


def _tp_size() -> int:
    return parallel_state.get_tensor_model_parallel_world_size()


# ---------------------------------------------------------------------------------------------
# LoRA


class Lora(PeftModule):
    def __init__(
        self, key: str, linear: Any, style: str, s: PeftSettings, sp: bool, gated: bool = False
    ) -> None:
        super().__init__(key, sp)
        self.style, self.scale, self.dropout = style, s.alpha / s.rank, s.dropout
        tp_size = _tp_size()
        if style == "column":  # A whole, B split by output rows (a gated fc1's as fc1's)
            self.add("lora_a", (s.rank, linear.input_size), s.column_init, None)
            self.add("lora_b", (linear.output_size // tp_size, s.rank), s.row_init, 0)
            if gated:
                self.gated_rows.add("lora_b")
        else:  # A split by input columns, B whole
            self.add("lora_a", (s.rank, linear.input_size // tp_size), s.column_init, 1)
            self.add("lora_b", (linear.output_size, s.rank), s.row_init, None)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        x = F.dropout(x, self.dropout, self.training)
        hidden = F.linear(x.to(self.lora_a.dtype), self.lora_a)
        if self.style == "column":
            hidden = (
                tp.gather_from_sequence_parallel_region(hidden)
                if self.sequence_parallel
                else tp.copy_to_tensor_model_parallel_region(hidden)
            )
        else:
            hidden = (
                tp.reduce_scatter_to_sequence_parallel_region(hidden)
                if self.sequence_parallel
                else tp.reduce_from_tensor_model_parallel_region(hidden)
            )
        return F.linear(hidden, self.lora_b) * self.scale

    def hook(self, _module: Any, args: tuple, output: Any) -> Any:
        out, bias = output
        return out + self.delta(args[0]).to(out.dtype), bias


# ---------------------------------------------------------------------------------------------
# Adapters


class Adapter(PeftModule):
    """A bottleneck MLP added residually to a block's output (attention or MLP)."""

    def __init__(self, key: str, hidden: int, s: PeftSettings, sp: bool) -> None:
        super().__init__(key, sp)
        tp_size = _tp_size()
        if s.rank % tp_size:
            raise RecipeError(
                f"adapter_dim {s.rank} does not split over tensor_model_parallel_size {tp_size}"
            )
        self.norm_position, self.dropout = s.norm_position, s.dropout
        self.activation = ADAPTER_ACTIVATIONS[s.activation]
        self.add("linear_in", (s.rank // tp_size, hidden), s.column_init, 0)
        self.add("linear_out", (hidden, s.rank // tp_size), s.row_init, 1)
        if s.norm_position:
            self.add("norm_weight", (hidden,), "ones", None)
            self.add("norm_bias", (hidden,), "zero", None)
        # The norm runs on this rank's tokens: its gradients need the TP all-reduce only then.

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = (x.shape[-1],)
        if self.norm_position == "pre":
            x = F.layer_norm(x, size, self.norm_weight, self.norm_bias)
        full = (
            tp.gather_from_sequence_parallel_region(x)
            if self.sequence_parallel
            else tp.copy_to_tensor_model_parallel_region(x)
        )
        hidden = self.activation(F.linear(full, self.linear_in))
        partial = F.linear(F.dropout(hidden, self.dropout, self.training), self.linear_out)
        out = (
            tp.reduce_scatter_to_sequence_parallel_region(partial)
            if self.sequence_parallel
            else tp.reduce_from_tensor_model_parallel_region(partial)
        )
        if self.norm_position == "post":
            out = F.layer_norm(out, size, self.norm_weight, self.norm_bias)
        return out

    def hook(self, _module: Any, _args: tuple, output: Any) -> Any:
        out, bias = output
        full = out + bias if bias is not None else out
        return out + self(full.to(self.linear_in.dtype)).to(out.dtype), bias


# ---------------------------------------------------------------------------------------------
# IA3


class KeyValueScale(PeftModule):
    """Scales the key and value features of linear_qkv's output (megatron-core lays it out as
    [query groups][queries of the group, key, value][head dim] on each TP rank), or of a
    cross-attention's linear_kv (`queries` False: [query groups][key, value][head dim])."""

    def __init__(self, key: str, config: Any, sp: bool, queries: bool = True) -> None:
        super().__init__(key, sp)
        groups = config.num_query_groups or config.num_attention_heads
        self.head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        self.queries_per_group = config.num_attention_heads // groups if queries else 0
        self.local_groups = groups // _tp_size()
        self.add("key_value_scale", (self.local_groups * 2 * self.head_dim,), "ones", 0)

    def hook(self, _module: Any, _args: tuple, output: Any) -> Any:
        out, bias = output
        shape = out.shape
        grouped = out.view(*shape[:-1], self.local_groups, self.queries_per_group + 2, -1)
        queries = grouped[..., : self.queries_per_group, :]
        scale = self.key_value_scale.view(self.local_groups, 2, self.head_dim).to(out.dtype)
        keys_values = grouped[..., self.queries_per_group :, :] * scale
        return torch.cat([queries, keys_values], dim=-2).reshape(shape), bias


class FfnScale(PeftModule):
    """Scales the MLP's intermediate activations (linear_fc2's input, split over TP)."""

    def __init__(self, key: str, config: Any, sp: bool) -> None:
        super().__init__(key, sp)
        self.add("ffn_scale", (config.ffn_hidden_size // _tp_size(),), "ones", 0)

    def pre_hook(self, _module: Any, args: tuple) -> tuple:
        return (args[0] * self.ffn_scale.to(args[0].dtype), *args[1:])


# ---------------------------------------------------------------------------------------------
# Prompt tuning and P-tuning


class VirtualPrompt(PeftModule):
    """The first `virtual_tokens` positions of every sequence take learned embeddings; the data
    puts placeholder ids there (never in the loss). On an embedding, the positions are its
    `position_ids` (each packed sample's own; a KV cache's decoding step, whose one token is
    past the prompt, is left as it is); on a stack's input, the sequence's first rows."""

    def __init__(self, key: str, hidden: int, s: PeftSettings, sp: bool) -> None:
        super().__init__(key, sp)
        self.tokens = s.virtual_tokens
        self.encoded = s.scheme == "ptuning"
        self.add("prompt_embeddings", (s.virtual_tokens, hidden), "normal", None)
        if self.encoded:
            width = s.encoder_hidden
            self.layers = s.encoder_layers
            dims = [hidden] + [width] * (s.encoder_layers - 1) + [hidden]
            for index, (fan_in, fan_out) in enumerate(zip(dims, dims[1:], strict=False)):
                self.add(f"encoder_{index}_weight", (fan_out, fan_in), "normal", None)
                self.add(f"encoder_{index}_bias", (fan_out,), "zero", None)

    def embeddings(self) -> torch.Tensor:
        values = self.prompt_embeddings
        if self.encoded:
            for index in range(self.layers):
                weight = getattr(self, f"encoder_{index}_weight")
                values = F.linear(values, weight, getattr(self, f"encoder_{index}_bias"))
                if index < self.layers - 1:
                    values = F.gelu(values)
        return values

    def input_hook(self, _module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple:
        """The same on a stack's `hidden_states` argument (an encoder that shares its
        embedding with a decoder, whose input must stay as it is)."""
        if kwargs.get("hidden_states") is not None:
            kwargs = {**kwargs, "hidden_states": self.hook(None, (), kwargs["hidden_states"])}
        elif args and args[0] is not None:
            args = (self.hook(None, (), args[0]), *args[1:])
        return args, kwargs

    def positioned_hook(
        self, module: Any, args: tuple, kwargs: dict[str, Any], output: torch.Tensor
    ) -> torch.Tensor:
        """An embedding's output [sequence (this rank's slice under sequence parallelism),
        batch, hidden]: where a token's position is below `tokens`, the learned embedding of
        that position."""
        positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        if positions is None:
            return self.hook(module, args, output)
        local = output.shape[0]
        rank = parallel_state.get_tensor_model_parallel_rank()
        start = rank * local if self.sequence_parallel else 0
        here = positions[:, start : start + local].transpose(0, 1)  # [local, batch]
        virtual = here < self.tokens
        if not bool(virtual.any()):
            return output
        prompt = self.embeddings().to(output.dtype)[here.clamp(max=self.tokens - 1)]
        return torch.where(virtual.unsqueeze(-1), prompt, output)

    def hook(self, _module: Any, _args: tuple, output: torch.Tensor) -> torch.Tensor:
        # output: [sequence (this rank's slice under sequence parallelism), batch, hidden]
        local = output.shape[0]
        rank = parallel_state.get_tensor_model_parallel_rank()
        start = rank * local if self.sequence_parallel else 0
        first, last = max(start, 0), min(start + local, self.tokens)
        if first >= last:
            return output
        prompt = self.embeddings()[first:last].to(output.dtype)
        prompt = prompt.unsqueeze(1).expand(-1, output.shape[1], -1)
        return torch.cat([output[: first - start], prompt, output[last - start :]], dim=0)


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


def attach(
    chunks: list[Any], settings: PeftSettings, config: Any, sites: PeftSites = DECODER_STACK
) -> Attached:
    """Add the method's modules to every chunk (before any DDP or fp16 wrapping). Each layer's
    modules follow its own config (an encoder's and a decoder's may differ)."""
    sp = bool(config.sequence_parallel)
    modules: list[PeftModule] = []
    handles: list[Any] = []

    def hook(module: Any, added: PeftModule, name: str, pre: bool = False) -> None:
        modules.append(added)
        register: Callable[..., Any] = (
            module.register_forward_pre_hook if pre else module.register_forward_hook
        )
        handles.append(register(getattr(added, name)))

    for chunk in chunks:
        if settings.scheme in ("ptuning", "prompt_tuning"):
            site = sites.prompt(chunk)
            if site is not None:
                module, on_input = site
                prompt = VirtualPrompt("prompt", config.hidden_size, settings, sp)
                _add(module, "virtual_prompt", prompt)
                modules.append(prompt)
                handles.append(
                    module.register_forward_pre_hook(prompt.input_hook, with_kwargs=True)
                    if on_input
                    else module.register_forward_hook(prompt.positioned_hook, with_kwargs=True)
                )
            continue
        for prefix, layer in sites.layers(chunk):
            number = int(layer.layer_number)
            if not settings.chosen(number):
                continue
            base, own = f"{prefix}{number}", layer.config
            attention, mlp = layer.self_attention, layer.mlp
            if settings.scheme == "lora":
                for target in settings.target_modules:
                    owner, linear_name, style = LORA_TARGETS[target]
                    linear = getattr(getattr(layer, owner, None), linear_name, None)
                    if linear is None:
                        continue
                    gated = target == "mlp_fc1" and bool(own.gated_linear_unit)
                    lora = Lora(f"{base}.{target}", linear, style, settings, sp, gated)
                    _add(layer, f"lora_{target}", lora)
                    hook(linear, lora, "hook")
            elif settings.scheme == "adapter":
                places = (("attention", attention.linear_proj), ("mlp", mlp.linear_fc2))
                for place, linear in places:
                    adapter = Adapter(f"{base}.adapter_{place}", own.hidden_size, settings, sp)
                    _add(layer, f"adapter_{place}", adapter)
                    hook(linear, adapter, "hook")
            elif settings.scheme == "ia3":
                kv = KeyValueScale(f"{base}.ia3_key_value", own, sp)
                _add(layer, "ia3_key_value", kv)
                hook(attention.linear_qkv, kv, "hook")
                cross = getattr(getattr(layer, "cross_attention", None), "linear_kv", None)
                if cross is not None:  # a decoder reading an encoder: its keys and values too
                    cross_kv = KeyValueScale(f"{base}.ia3_cross_key_value", own, sp, False)
                    _add(layer, "ia3_cross_key_value", cross_kv)
                    hook(cross, cross_kv, "hook")
                ffn = FfnScale(f"{base}.ia3_ffn", own, sp)
                _add(layer, "ia3_ffn", ffn)
                hook(mlp.linear_fc2, ffn, "pre_hook", pre=True)
    return Attached(modules, handles)


def _add(owner: Any, name: str, module: PeftModule) -> None:
    module.child_name = name
    owner.add_module(name, module)


def freeze_base(chunks: list[Any]) -> None:
    """Only the added modules learn."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            param.requires_grad = is_peft_parameter(name)


def is_peft_parameter(name: str) -> bool:
    parts = name.split(".")
    return any(
        part.startswith(("lora_", "adapter_", "ia3_")) or part == "virtual_prompt"
        for part in parts[:-1]
    )


def initial_values(attached: Attached, seed: int, std: float) -> Callable[[Any], torch.Tensor]:
    """For init_weights.assign_global: the layout-independent start of each added tensor."""
    inits = {f"{m.key}.{name}": init for m in attached.modules for name, init in m.inits.items()}

    def value(tensor: Any) -> torch.Tensor:
        init = inits[tensor.key.split(PEFT_SEGMENT, 1)[1]]
        return initial_value(tensor.key, tuple(tensor.global_shape), init, seed, std)

    return value


def is_peft_key(key: str) -> bool:
    return key.startswith(PEFT_SEGMENT) or f".{PEFT_SEGMENT}" in key
