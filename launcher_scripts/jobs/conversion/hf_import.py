"""The import job: a local Hugging Face model directory to the portable file.

    python -m launcher_scripts.jobs.conversion.hf_import --config <results_dir>/<name>_hydra.yaml

The family that imports the directory's config.json model_type maps its tensors to our names
(ModelRuntime.from_hf), reading them one by one from the safetensors files; the tokenizer's
files go into the portable file with it, so that every later stage encodes text to the ids
the model was trained with. A field the family cannot represent exactly is refused in one line.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher_scripts.jobs.config_job import run_config_job
from launcher_scripts.jobs.models.base import HfImportError

INDEX = "model.safetensors.index.json"


@contextlib.contextmanager
def tensor_reader(directory: Path) -> Iterator[tuple[Callable[[str], Any], set[str]]]:
    """(read(name) -> one tensor, the names the checkpoint holds), over model.safetensors or a
    sharded checkpoint's index. Each read loads that tensor alone."""
    from safetensors import safe_open

    index = directory / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (directory / "model.safetensors").is_file():
        weight_map, files = None, ["model.safetensors"]
    else:
        raise HfImportError(
            f"{directory} has no model.safetensors (nor {INDEX}): save the model with "
            "safe_serialization (transformers' default)"
        )
    with contextlib.ExitStack() as stack:
        opened = {name: stack.enter_context(safe_open(directory / name, "pt")) for name in files}
        if weight_map is None:
            weight_map = {key: files[0] for key in opened[files[0]].keys()}  # noqa: SIM118

        def read(name: str) -> Any:
            if name not in weight_map:
                raise HfImportError(f"{directory}: the checkpoint has no tensor {name}")
            return opened[weight_map[name]].get_tensor(name)

        yield read, set(weight_map)


def hf_import(cfg: DictConfig) -> None:
    from launcher_scripts.families import family_of
    from launcher_scripts.formats import portable
    from launcher_scripts.jobs.models.base import runtime_of

    directory = Path(str(cfg.hf_model_dir))
    config = json.loads((directory / "config.json").read_text())
    family = family_of(cfg, "conversion")
    runtime = runtime_of(family)
    assert runtime.from_hf is not None, "preflight checks the family imports"
    with tensor_reader(directory) as (read, _names):
        model, tensors = runtime.from_hf(directory, config, read, cfg.model)
    model["tensor_model_parallel_size"] = int(cfg.model.tensor_model_parallel_size)
    model["pipeline_model_parallel_size"] = int(cfg.model.pipeline_model_parallel_size)
    output = Path(str(cfg.run.output_path)) / str(cfg.run.nemo_file_name)
    portable.write(output, OmegaConf.create(model), tensors)
    values = sum(t.numel() for t in tensors.values())
    print(
        f"imported {directory} ({config.get('model_type')}, {len(tensors)} tensors, "
        f"{values:,} values) as a {family.name} model",
        flush=True,
    )
    print(f"wrote {output} ({output.stat().st_size / 1e6:.1f} MB)", flush=True)


def _input_errors() -> tuple[type[BaseException], ...]:
    from launcher_scripts.errors import ConfigError

    return (HfImportError, ConfigError, KeyError, OSError)


def main(argv: list[str] | None = None) -> int:
    return run_config_job(
        argv, __doc__.splitlines()[0], "conversion", hf_import, _input_errors, "hf_import"
    )


if __name__ == "__main__":
    sys.exit(main())
