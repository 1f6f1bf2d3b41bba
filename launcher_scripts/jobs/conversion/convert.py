"""The conversion job: a training checkpoint to a portable .nemo-style file and a Hugging Face
directory.

    python -m launcher_scripts.jobs.conversion.convert --config <results_dir>/<name>_hydra.yaml
        [--output FILE]

--output: write the portable file there, and no Hugging Face directory (the evaluation stage's
conversion of the training checkpoint it evaluates; its config is the evaluation's).

megatron-core checkpoints are layout-free (every tensor is stored with its global shape and
offsets), so one process reads a checkpoint written at any TP/PP/DP and gets full tensors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from launcher_scripts.families import DEFAULT, family_mismatch
from launcher_scripts.files import replaced_directory
from launcher_scripts.jobs.config_job import run_config_job
from launcher_scripts.recipes.conversion import (
    ConversionError,
    checkpoint_name,
    hparams_path,
    pick_checkpoint,
    read_hparams,
    with_tokenizer_files,
)


def model_tensors(checkpoint: Path) -> dict[str, Any]:
    """Every model tensor of a checkpoint, in full, by megatron-core name."""
    import torch
    from megatron.core.dist_checkpointing import load_plain_tensors

    state = load_plain_tensors(str(checkpoint))
    return {
        key: value
        for key, value in state.items()
        if torch.is_tensor(value)
        and "optimizer" not in key.split(".")[:2]  # "optimizer..." or "chained_<i>.optimizer..."
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

    from launcher_scripts.families import family_of
    from launcher_scripts.jobs.conversion import hf_tokenizer
    from launcher_scripts.jobs.models.base import runtime_of
    from launcher_scripts.jobs.models.hf_common import unpadded_vocabulary

    to_hf = runtime_of(family_of(model, "conversion")).to_hf
    assert to_hf is not None, "preflight checks the family's hf_architecture"
    # An imported model goes back with its checkpoint's rows, without the import's padding.
    exported = to_hf(model, unpadded_vocabulary(model, tensors))
    config = exported.config | hf_tokenizer.write(model, directory, exported.added_tokens)
    if "score.weight" in exported.state and "eos_token_id" in config:
        # A sequence classifier finds each row's last token by its padding: ours is the
        # end-of-document token, which no scored text ends with.
        config.setdefault("pad_token_id", config["eos_token_id"])
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # Own storage for each: per-layer slices of one stacked tensor must not share memory.
    state = {
        name: t.clone(memory_format=torch.contiguous_format) for name, t in exported.state.items()
    }
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


def write_hf_from_portable(model_file: Path, directory: Path) -> Path:
    """A portable file as a Hugging Face directory (config.json, weights, tokenizer)."""
    import tempfile

    from launcher_scripts.formats import portable

    with tempfile.TemporaryDirectory() as scratch:
        model = portable.read(model_file, Path(scratch))
        tensors = {key: model.tensors[key] for key in list(model.tensors.keys())}
        directory.mkdir(parents=True, exist_ok=True)
        write_hf_files(directory, model.config, tensors)
    return directory


def convert(cfg: DictConfig, output: Path | None = None) -> None:
    from launcher_scripts.formats import portable

    model_cfg = cfg.model
    hparams_file = hparams_path(model_cfg)
    hparams = with_tokenizer_files(read_hparams(hparams_file), model_cfg)
    family = cfg.get("model_family", DEFAULT)
    problem = family_mismatch(hparams, family, str(hparams_file))
    if problem:
        raise ConversionError(problem, "conversion.model_family")
    # Whoever loads the file builds the model of its family.
    hparams.model_family = family
    checkpoint = pick_checkpoint(Path(str(model_cfg.checkpoint_folder)), checkpoint_name(model_cfg))
    print(f"checkpoint {checkpoint.path} (step {checkpoint.state.step})", flush=True)
    _init_single_process()
    tensors = model_tensors(checkpoint.path)
    parameters = sum(t.numel() for t in tensors.values())
    print(f"read {len(tensors)} tensors, {parameters:,} values", flush=True)

    # The layout consumers of the file start from (the weights themselves are full tensors).
    hparams.tensor_model_parallel_size = int(model_cfg.tensor_model_parallel_size)
    hparams.pipeline_model_parallel_size = int(model_cfg.pipeline_model_parallel_size)
    hf_dir_name = cfg.run.get("hf_dir_name") if output is None else None
    if output is None:
        output = Path(str(cfg.run.output_path)) / str(cfg.run.nemo_file_name)
    if not hf_dir_name:
        output.parent.mkdir(parents=True, exist_ok=True)
        portable.write(output, hparams, tensors)
    else:
        # Both outputs are built beside the old ones and replace them only when both are
        # whole: a failure leaves the last good pair, not a new file beside an old folder.
        hf_dir = Path(str(cfg.run.output_path)) / str(hf_dir_name)
        with replaced_directory(hf_dir) as partial:
            write_hf_files(partial, hparams, tensors)
            portable.write(output, hparams, tensors)
        print(f"wrote {hf_dir} (Hugging Face transformers)", flush=True)
    print(f"wrote {output} ({output.stat().st_size / 1e6:.1f} MB)", flush=True)


def _input_errors() -> tuple[type[BaseException], ...]:
    from launcher_scripts.errors import ConfigError

    return (ConversionError, ConfigError)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    output = None
    for index, arg in enumerate(args):
        if arg.startswith("--output="):
            output = Path(arg.partition("=")[2])
            del args[index]
            break

    def job(cfg: DictConfig) -> None:
        convert(cfg, output)

    return run_config_job(args, __doc__.splitlines()[0], "conversion", job, _input_errors)


if __name__ == "__main__":
    sys.exit(main())
