"""The portable checkpoint: one tar file, like NeMo's .nemo, that later stages load at any layout.

    model_config.yaml          the training recipe's model section (plus precision); its
                               tensor/pipeline sizes are the layout consumers start from
    model_weights.safetensors  every model tensor in full, under megatron-core's names
    tokenizer/<files>          the tokenizer; model_config.yaml points at these relative paths

Full tensors, not per-rank shards: whoever loads the file takes its own slice, so one file
serves every TP/PP layout (see load_into).
"""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from launcher_scripts.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where tensors are written or read: read_config needs none
    import torch

CONFIG = "model_config.yaml"
WEIGHTS = "model_weights.safetensors"
TOKENIZER_DIR = "tokenizer"
TOKENIZER_KEYS = ("model", "vocab_file", "merge_file")
# What a PEFT file (launcher_scripts/jobs/fine_tuning/peft_file.py) holds instead of CONFIG.
PEFT_CONFIG = "peft_config.yaml"


@dataclass
class Portable:
    config: DictConfig  # tokenizer paths made absolute where the file was extracted
    tensors: dict[str, torch.Tensor]


def write(path: Path, model_config: DictConfig, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Write the tar atomically (a temporary name, then rename). Returns its member names."""
    from safetensors.torch import save_file

    config = OmegaConf.create(OmegaConf.to_container(model_config, resolve=True))
    tokenizer_files: dict[str, Path] = {}
    for key in TOKENIZER_KEYS:
        value = config.tokenizer.get(key)
        if value:
            source = Path(str(value))
            member = f"{TOKENIZER_DIR}/{source.name}"
            tokenizer_files[member] = source
            config.tokenizer[key] = member
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".convert-") as scratch:
        weights = Path(scratch) / WEIGHTS
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(weights))
        partial = Path(scratch) / path.name
        with tarfile.open(partial, "w") as tar:
            add_bytes(tar, CONFIG, OmegaConf.to_yaml(config).encode())
            tar.add(weights, arcname=WEIGHTS, filter=readable)
            for member, source in tokenizer_files.items():
                tar.add(source, arcname=member, filter=readable)
            names = tar.getnames()
        os.replace(partial, path)
    return names


def readable(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """Members anyone may read, owned by nobody in particular (the file is shared)."""
    info.mode, info.uid, info.gid, info.uname, info.gname = 0o644, 0, 0, "", ""
    return info


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = readable(tarfile.TarInfo(name))
    info.size = len(data)
    info.mtime = int(time.time())
    tar.addfile(info, io.BytesIO(data))


def read_config(path: Path) -> DictConfig:
    """The model config of a whole, complete portable file, without reading the weights.

    ValueError (saying what is wrong) when `path` is no tar, is cut short, is a PEFT file or
    lacks a member: the one check every stage that takes a .nemo runs in preflight, so a bad
    file is refused before a job replaces anything.
    """
    try:
        with tarfile.open(path) as tar:
            names = _check_complete(tar, path)
            config = _config(tar, path)
    except tarfile.TarError as error:
        raise ValueError(f"{path} is not a complete tar file ({error}): truncated?") from None
    tokenizer = config.get("tokenizer") or {}
    for key in TOKENIZER_KEYS:
        member = str(tokenizer.get(key) or "")
        if member.startswith(f"{TOKENIZER_DIR}/") and member not in names:
            raise ValueError(f"{path} has no {member} (its tokenizer.{key}): cut short?")
    return config


def require_model_file(path: Path, key: str) -> DictConfig:
    """Preflight of a .nemo input: its model config, or ConfigError naming `key`."""
    try:
        return read_config(path)
    except (OSError, ValueError) as error:
        raise ConfigError(
            key,
            f"{path} is not a usable portable model file: {error}",
            "Give the .nemo file the conversion stage (or merge-lora, or full fine-tuning) writes",
        ) from None


def _check_complete(tar: tarfile.TarFile, path: Path) -> set[str]:
    """The member names of a tar whose every member is whole and that holds a model."""
    members = tar.getmembers()  # reads every header: a cut inside one raises TarError
    names = {member.name for member in members}
    if PEFT_CONFIG in names and CONFIG not in names:
        raise ValueError(
            f"{path} is a PEFT file (only the tuned tensors, not a whole model): merge it "
            "into its base model first (python3 -m launcher_scripts merge-lora BASE PEFT "
            "OUT) or give the base model"
        )
    for required in (CONFIG, WEIGHTS):
        if required not in names:
            raise ValueError(f"{path} has no {required}: not a portable file, or cut short")
    size = path.stat().st_size
    for member in members:
        if member.isfile() and member.offset_data + member.size > size:
            raise ValueError(
                f"{path} is cut short: {member.name} needs {member.offset_data + member.size} "
                f"bytes, the file has {size}"
            )
    return names


def _config(tar: tarfile.TarFile, path: Path) -> DictConfig:
    try:
        member = tar.extractfile(CONFIG)
    except KeyError:
        member = None
    if member is None:
        raise ValueError(f"{path} is not a portable checkpoint (no {CONFIG})")
    config = OmegaConf.create(member.read().decode())
    if not isinstance(config, DictConfig):
        raise ValueError(f"{path}: {CONFIG} is not a mapping")
    return config


def read(path: Path, workdir: Path) -> Portable:
    """Read the tar; tokenizer files are extracted under `workdir`."""
    from safetensors.torch import load as load_safetensors

    with tarfile.open(path) as tar:
        config = _config(tar, path)
        weights_file = tar.extractfile(WEIGHTS)
        if weights_file is None:
            raise ValueError(f"{path} is not a portable checkpoint (no {WEIGHTS})")
        tensors = load_safetensors(weights_file.read())
        members = [m for m in tar.getmembers() if m.name.startswith(f"{TOKENIZER_DIR}/")]
        tar.extractall(workdir, members=members, filter="data")
    for key in TOKENIZER_KEYS:
        value = config.tokenizer.get(key)
        if value:
            config.tokenizer[key] = str(workdir / str(value))
    return Portable(config, tensors)
