"""What the conversion stage and its job read: which checkpoint of a training run to convert,
the model section training saved beside it, and the tokenizer files the recipe may repoint."""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher_scripts.formats.progress import Checkpoint, complete_checkpoints, damaged_checkpoints


class ConversionError(Exception):
    """Bad inputs: printed as one line. `key`: the recipe key to name in a preflight."""

    def __init__(self, message: str, key: str = "conversion.model.checkpoint_name") -> None:
        super().__init__(message)
        self.key = key


# NeMo's conversion.model keys naming the tokenizer files to pack (null: as training recorded)
TOKENIZER_FILES = ("vocab_file", "merge_file")


def hparams_path(model: Any) -> Path:
    """model.hparams_file; unset, the hparams.yaml beside the checkpoint folder, where
    training writes it (<explicit_log_dir>/hparams.yaml and checkpoints/)."""
    given = model.get("hparams_file")
    if given:
        return Path(str(given))
    return Path(str(model.checkpoint_folder)).parent / "hparams.yaml"


def checkpoint_name(model: Any) -> str:
    """model.checkpoint_name; unset, `latest`."""
    return str(model.get("checkpoint_name") or "latest")


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
