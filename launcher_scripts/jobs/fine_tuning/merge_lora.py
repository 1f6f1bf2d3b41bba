"""`python3 -m launcher_scripts merge-lora BASE.nemo PEFT.nemo OUTPUT.nemo`: fold LoRA into the
base weights (W + alpha/rank x B A for every adapted linear of every adapted layer) and write a
portable checkpoint that export, evaluation and conversion read like any other model."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

# The families register the tensor shapes inspect_portable checks a model file's weights against.
import launcher_scripts.families  # noqa: F401
from launcher_scripts.families.file_family import pair_problem
from launcher_scripts.formats import portable
from launcher_scripts.formats.portable_check import inspect_peft, inspect_portable
from launcher_scripts.jobs.fine_tuning import peft_file
from launcher_scripts.recipes.tuning import LORA_LINEARS, PeftSettings

PEFT_SEGMENT = "peft."  # what starts an added tensor's key (peft.PEFT_SEGMENT)


class MergeError(ValueError):
    pass


def base_weight(key: str) -> tuple[str, int]:
    """A LoRA tensor's key -> (the base weight it adapts, stacked over layers: [layers, out,
    in]; the layer's index there). Keys are `peft.[<stack>.]<layer number>.<target>.lora_a`:
    a decoder stack's layers have no stack name, an encoder-decoder's say which (T5's
    encoder. and decoder.)."""
    *stack, number, target = key.split(PEFT_SEGMENT, 1)[1].removesuffix(".lora_a").split(".")
    owner, linear = LORA_LINEARS[target]
    return f"{'.'.join(stack) or 'decoder'}.layers.{owner}.{linear}.weight", int(number) - 1


def merged(
    tensors: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], settings: PeftSettings
) -> dict[str, torch.Tensor]:
    """The base tensors with every LoRA update added (new tensors; the inputs are unchanged)."""
    if settings.scheme != "lora":
        raise MergeError(f"the PEFT file holds {settings.scheme}, not LoRA: only LoRA merges")
    out = dict(tensors)
    scale = settings.alpha / settings.rank
    for key, a in lora.items():
        if not key.endswith(".lora_a"):
            continue
        base_key, index = base_weight(key)
        if base_key not in out:
            raise MergeError(f"the base model has no {base_key} for {key}")
        if index >= out[base_key].shape[0]:
            raise MergeError(
                f"{key} adapts layer {index + 1}, but the base model's {base_key} has "
                f"{out[base_key].shape[0]} layers: was the PEFT file tuned on this base model?"
            )
        b = lora[key.removesuffix("lora_a") + "lora_b"]
        if out[base_key] is tensors[base_key]:  # first update of this weight: copy it
            out[base_key] = tensors[base_key].clone()
        weights = out[base_key]
        update = (b.double() @ a.double()) * scale
        if tuple(update.shape) != tuple(weights[index].shape):
            raise MergeError(
                f"{key}: the update has shape {tuple(update.shape)}, the base weight "
                f"{tuple(weights[index].shape)}: was the PEFT file tuned on this base model?"
            )
        weights[index] = (weights[index].double() + update).to(weights.dtype)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m launcher_scripts merge-lora", description=__doc__
    )
    parser.add_argument("base", type=Path, help="the base model's portable .nemo file")
    parser.add_argument("peft", type=Path, help="the PEFT .nemo file the peft stage wrote")
    parser.add_argument("output", type=Path, help="where to write the merged .nemo file")
    args = parser.parse_args(argv)
    try:
        if args.output.resolve() in (args.base.resolve(), args.peft.resolve()):
            raise MergeError("the output must not overwrite an input: choose another path")
        # Both whole and readable before anything is loaded or written.
        base_model = inspect_portable(args.base).config
        problem = pair_problem(inspect_peft(args.peft).config, args.peft, base_model, args.base)
        if problem is not None:
            raise MergeError(". ".join(problem))
        lora = peft_file.read(args.peft)
        with tempfile.TemporaryDirectory() as scratch:
            base = portable.read(args.base, Path(scratch))
            tensors = merged(base.tensors, lora.tensors, lora.settings)
            portable.write(args.output, base.config, tensors)
    except (OSError, ValueError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"merged LoRA from {args.peft} into {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
