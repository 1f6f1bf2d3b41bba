"""The conversion job: a training checkpoint to a portable .nemo-style file and a Hugging Face
directory.

    python -m launcher_scripts.jobs.conversion.convert --config <results_dir>/<name>_hydra.yaml

megatron-core checkpoints are layout-free (every tensor is stored with its global shape and
offsets), so one process reads a checkpoint written at any TP/PP/DP and gets full tensors.
"""

from __future__ import annotations

import fnmatch
import json
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher_scripts.files import replaced_directory
from launcher_scripts.jobs.config_job import run_config_job
from launcher_scripts.jobs.training.progress import (
    Checkpoint,
    complete_checkpoints,
    damaged_checkpoints,
)


class ConversionError(Exception):
    """Bad inputs: printed as one line. `key`: the recipe key to name in a preflight."""

    def __init__(self, message: str, key: str = "conversion.model.checkpoint_name") -> None:
        super().__init__(message)
        self.key = key


CONVERTED_FAMILIES = ("gpt",)  # the recipes' model_family values this job reads
# NeMo's conversion.model keys naming the tokenizer files to pack (null: as training recorded)
TOKENIZER_FILES = ("vocab_file", "merge_file")


def pick_checkpoint(folder: Path, name: str) -> Checkpoint:
    """`latest` is the newest complete checkpoint; anything else is a name pattern (fnmatch),
    of which the newest matching one is taken. A damaged checkpoint (a file missing or cut
    short) newer than that is an error: converting an older one instead would be a surprise."""
    found = complete_checkpoints(folder)
    wanted = (
        (lambda c: True) if name == "latest" else (lambda c: fnmatch.fnmatch(c.path.name, name))
    )
    damaged = [(c, why) for c, why in damaged_checkpoints(folder) if wanted(c)]
    matching = [c for c in found if wanted(c)]
    if damaged and (not matching or damaged[-1][0].state.step > matching[-1].state.step):
        bad, problem = damaged[-1]
        instead = (
            f"convert the newest complete one with conversion.model.checkpoint_name="
            f"{matching[-1].path.name!r}, or "
            if matching
            else ""
        )
        raise ConversionError(
            f"checkpoint {bad.path} is damaged ({problem}): {instead}restore its files from "
            "a copy (or resume training, which continues from the previous complete one)"
        )
    if not found:
        raise ConversionError(
            f"no complete checkpoint in {folder}: train first, or point "
            "conversion.model.checkpoint_folder at a training run's checkpoints",
            "conversion.model.checkpoint_folder",
        )
    if not matching:
        names = ", ".join(c.path.name for c in found)
        raise ConversionError(
            f"{name!r} matches none of: {names}. "
            "Use latest or one of these names (wildcards allowed)"
        )
    return matching[-1]


def with_tokenizer_files(hparams: DictConfig, model_cfg: Any) -> DictConfig:
    """The trained model's section with the recipe's tokenizer files (conversion.model.
    vocab_file / merge_file, when set) in place of the paths training recorded: the same
    files where they are now, e.g. in a workspace mounted elsewhere."""
    for name in TOKENIZER_FILES:
        value = model_cfg.get(name)
        if value is not None:
            hparams.tokenizer[name] = str(value)
    return hparams


def read_hparams(path: Path) -> DictConfig:
    """The model section training saved (NeMo's layout: under a top-level `cfg`)."""
    loaded = OmegaConf.load(path)
    model = loaded.get("cfg", loaded)
    assert isinstance(model, DictConfig)
    return model


def model_tensors(checkpoint: Path) -> dict[str, Any]:
    """Every model tensor of a checkpoint, in full, by megatron-core name."""
    import torch
    from megatron.core.dist_checkpointing import load_plain_tensors

    state = load_plain_tensors(str(checkpoint))
    return {
        key: value
        for key, value in state.items()
        if torch.is_tensor(value)
        and not key.startswith("optimizer")
        and not key.endswith("_extra_state")
    }


def _init_single_process() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")


def write_hf_files(directory: Path, model: DictConfig, tensors: dict[str, Any]) -> None:
    """config.json, model.safetensors and the tokenizer, into `directory`."""
    import torch
    from safetensors.torch import save_file

    from launcher_scripts.jobs.conversion import hf_tokenizer
    from launcher_scripts.jobs.conversion.hf_export import to_hf

    config, state = to_hf(model, tensors)
    config |= hf_tokenizer.write(model, directory)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # Own storage for each: per-layer slices of one stacked tensor must not share memory.
    state = {name: t.clone(memory_format=torch.contiguous_format) for name, t in state.items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


def convert(cfg: DictConfig) -> None:
    from launcher_scripts.jobs.conversion import portable

    model_cfg = cfg.model
    hparams = with_tokenizer_files(read_hparams(Path(str(model_cfg.hparams_file))), model_cfg)
    checkpoint = pick_checkpoint(
        Path(str(model_cfg.checkpoint_folder)), str(model_cfg.checkpoint_name)
    )
    print(f"checkpoint {checkpoint.path} (step {checkpoint.state.step})", flush=True)
    _init_single_process()
    tensors = model_tensors(checkpoint.path)
    parameters = sum(t.numel() for t in tensors.values())
    print(f"read {len(tensors)} tensors, {parameters:,} values", flush=True)

    # The layout consumers of the file start from (the weights themselves are full tensors).
    hparams.tensor_model_parallel_size = int(model_cfg.tensor_model_parallel_size)
    hparams.pipeline_model_parallel_size = int(model_cfg.pipeline_model_parallel_size)
    output = Path(str(cfg.run.output_path)) / str(cfg.run.nemo_file_name)
    if not cfg.run.get("hf_dir_name"):
        portable.write(output, hparams, tensors)
    else:
        # Both outputs are built beside the old ones and replace them only when both are
        # whole: a failure leaves the last good pair, not a new file beside an old folder.
        hf_dir = Path(str(cfg.run.output_path)) / str(cfg.run.hf_dir_name)
        with replaced_directory(hf_dir) as partial:
            write_hf_files(partial, hparams, tensors)
            portable.write(output, hparams, tensors)
        print(f"wrote {hf_dir} (Hugging Face transformers)", flush=True)
    print(f"wrote {output} ({output.stat().st_size / 1e6:.1f} MB)", flush=True)


def _input_errors() -> tuple[type[BaseException], ...]:
    from launcher_scripts.errors import ConfigError

    return (ConversionError, ConfigError)


def main(argv: list[str] | None = None) -> int:
    return run_config_job(
        argv, __doc__.splitlines()[0], "conversion", convert, _input_errors, CONVERTED_FAMILIES
    )


if __name__ == "__main__":
    sys.exit(main())
