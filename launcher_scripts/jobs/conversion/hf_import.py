"""The import job: a local Hugging Face model directory to the portable file.

    python -m launcher_scripts.jobs.conversion.hf_import --config <results_dir>/<name>_hydra.yaml

The family that imports the directory's config.json model_type maps its tensors to our names
(its `hf_importer` module, which needs no megatron-core). Each of ours is made from the
safetensors files and written a layer at a time (formats/safetensors_stream), so the job holds
a layer's tensors, not the model. The vocabulary's rows are padded to a multiple of
make_vocab_size_divisible_by x TP, as Megatron pads them, so that any checkpoint splits over
the file's TP; the export drops the padding again. The tokenizer's files go into the portable
file with it, so that every later stage encodes text to the ids the model was trained with. A
field the family cannot represent exactly, and a checkpoint whose tensors or tokenizer disagree
with its config.json (the family's hf_import_check, which preflight asked too), are refused in
one line.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from launcher_scripts.jobs.config_job import run_config_job
from launcher_scripts.jobs.models.base import HfImportError


def hf_import(cfg: DictConfig) -> None:
    from launcher_scripts.families import family_of
    from launcher_scripts.formats import portable
    from launcher_scripts.formats.safetensors_stream import TensorSource
    from launcher_scripts.jobs.models.hf_common import padded_vocabulary
    from launcher_scripts.recipes.model_shape import padded_vocab

    directory = Path(str(cfg.hf_model_dir))
    config = json.loads((directory / "config.json").read_text())
    family = family_of(cfg, "conversion")
    assert family.hf_importer is not None, "preflight checks the family imports"
    if family.hf_import_check is not None:  # again: the directory may have changed since
        family.hf_import_check(directory, config)
    importer = importlib.import_module(family.hf_importer)
    model, tensors = importer.import_hf(directory, config, TensorSource(directory), cfg.model)
    tensor = int(cfg.model.tensor_model_parallel_size)
    model["tensor_model_parallel_size"] = tensor
    model["pipeline_model_parallel_size"] = int(cfg.model.pipeline_model_parallel_size)
    # megatron-core splits the vocabulary rows over TP: padded as Megatron pads them, and the
    # checkpoint's count recorded for the export.
    rows = next(t.shape[0] for t in tensors if t.name == portable.EMBEDDINGS)
    divisor = int(cfg.model.get("make_vocab_size_divisible_by") or 1)
    padded = padded_vocab(rows, divisor, tensor)
    tensors = padded_vocabulary(tensors, padded)
    model[portable.HF_VOCAB_SIZE] = rows
    output = Path(str(cfg.run.output_path)) / str(cfg.run.nemo_file_name)
    portable.write_streamed(output, OmegaConf.create(model), tensors)
    values = sum(math.prod(t.shape) for t in tensors)
    print(
        f"imported {directory} ({config.get('model_type')}, {len(tensors)} tensors, "
        f"{values:,} values) as a {family.name} model",
        flush=True,
    )
    if padded != rows:
        print(
            f"padded the vocabulary's {rows} rows to {padded}, a multiple of TP={tensor}"
            f"{f' x {divisor}' if divisor > 1 else ''} (the export drops them again)",
            flush=True,
        )
    print(f"wrote {output} ({output.stat().st_size / 1e6:.1f} MB)", flush=True)


def _input_errors() -> tuple[type[BaseException], ...]:
    from launcher_scripts.errors import ConfigError
    from launcher_scripts.formats.safetensors_stream import SafetensorsError

    return (HfImportError, SafetensorsError, ConfigError, KeyError, OSError)


def main(argv: list[str] | None = None) -> int:
    return run_config_job(
        argv, __doc__.splitlines()[0], "conversion", hf_import, _input_errors, "hf_import"
    )


if __name__ == "__main__":
    sys.exit(main())
