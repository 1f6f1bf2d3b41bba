"""`python3 -m launcher_scripts merge-lora BASE.nemo PEFT.nemo OUTPUT.nemo`: fold a PEFT file
into the base weights (LoRA: W + alpha/rank x B A for every adapted linear of every adapted
layer) and write a portable checkpoint that export, evaluation and conversion read like any
other model."""

from __future__ import annotations

import argparse
import importlib
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
from launcher_scripts.jobs.fine_tuning.peft import MergeError
from launcher_scripts.tuning import PeftSettings, merging_titles

__all__ = ["MergeError", "merged"]


def merged(
    tensors: dict[str, torch.Tensor], added: dict[str, torch.Tensor], settings: PeftSettings
) -> dict[str, torch.Tensor]:
    """The base tensors with the PEFT file's updates folded in (new tensors; the inputs are
    unchanged), by the method's own merge."""
    if not settings.method.merges:
        raise MergeError(
            f"the PEFT file holds {settings.scheme}, and only {merging_titles()} folds into the "
            "weights"
        )
    return importlib.import_module(settings.method.runtime).merged(tensors, added, settings)


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
