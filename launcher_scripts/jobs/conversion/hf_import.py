"""The import job: a local Hugging Face model directory to the portable file.

    python -m launcher_scripts.jobs.conversion.hf_import --config <results_dir>/<name>_hydra.yaml

The family that imports the directory's config.json model_type maps its tensors to our names
(its `hf_importer` module, which needs no megatron-core). Each of ours is made from the
safetensors files and written a layer at a time (formats/safetensors_stream), so the job holds
a layer's tensors, not the model. The tokenizer's files go into the portable file with it, so
that every later stage encodes text to the ids the model was trained with. A field the family
cannot represent exactly is refused in one line.
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

    directory = Path(str(cfg.hf_model_dir))
    config = json.loads((directory / "config.json").read_text())
    family = family_of(cfg, "conversion")
    assert family.hf_importer is not None, "preflight checks the family imports"
    importer = importlib.import_module(family.hf_importer)
    model, tensors = importer.import_hf(directory, config, TensorSource(directory), cfg.model)
    model["tensor_model_parallel_size"] = int(cfg.model.tensor_model_parallel_size)
    model["pipeline_model_parallel_size"] = int(cfg.model.pipeline_model_parallel_size)
    output = Path(str(cfg.run.output_path)) / str(cfg.run.nemo_file_name)
    portable.write_streamed(output, OmegaConf.create(model), tensors)
    values = sum(math.prod(t.shape) for t in tensors)
    print(
        f"imported {directory} ({config.get('model_type')}, {len(tensors)} tensors, "
        f"{values:,} values) as a {family.name} model",
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
