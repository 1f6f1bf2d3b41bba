"""Prompt tuning's and P-tuning's module: the first `virtual_tokens` input embeddings
replaced by learned ones (P-tuning: produced by an MLP from learned inputs)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from megatron.core import parallel_state

from launcher_scripts.jobs.fine_tuning.peft import Attaching, PeftModule, PeftSites
from launcher_scripts.tuning import PeftSettings
from launcher_scripts.tuning.prompt import encodes


class VirtualPrompt(PeftModule):
    """The first `virtual_tokens` positions of every sequence take learned embeddings; the data
    puts placeholder ids there (never in the loss). On an embedding, the positions are its
    `position_ids` (each packed sample's own; a KV cache's decoding step, whose one token is
    past the prompt, is left as it is); on a stack's input, the sequence's first rows."""

    def __init__(self, key: str, hidden: int, s: PeftSettings, sp: bool) -> None:
        super().__init__(key, sp)
        self.tokens = s.virtual_tokens
        self.encoded = encodes(s)
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


def attach(
    chunk: Any, sites: PeftSites, settings: PeftSettings, config: Any, to: Attaching
) -> None:
    site = sites.prompt(chunk)
    if site is None:
        return
    module, on_input = site
    prompt = VirtualPrompt("prompt", config.hidden_size, settings, to.sequence_parallel)
    if on_input:
        to.add(
            module, "virtual_prompt", prompt, module, prompt.input_hook, pre=True, with_kwargs=True
        )
    else:
        to.add(module, "virtual_prompt", prompt, module, prompt.positioned_hook, with_kwargs=True)
