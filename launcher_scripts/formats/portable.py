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
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

if TYPE_CHECKING:  # torch is imported where tensors are written or read: read_config needs none
    import torch

    from launcher_scripts.formats.safetensors_stream import StreamedTensor, TensorFile

CONFIG = "model_config.yaml"
WEIGHTS = "model_weights.safetensors"
EMBEDDINGS = "embedding.word_embeddings.weight"  # its rows: the model's (padded) vocabulary
# An imported model's config key: how many rows of EMBEDDINGS (and of an output layer of its
# own) were the Hugging Face checkpoint's before the import padded them for TP; the export
# writes back that many.
HF_VOCAB_SIZE = "hf_vocab_size"
# A reward model's file (the rlhf_rm stage's): its scalar head instead of an output layer, and
# a model_config.yaml section with the rewards' mean and std over its validation pairs.
REWARD_HEAD = "reward_head.weight"
REWARD_MODEL = "reward_model"
TOKENIZER_DIR = "tokenizer"
# The tokenizer's files (hf_config: an imported model's own tokenizer_config.json, which its
# Hugging Face export writes back).
TOKENIZER_KEYS = ("model", "vocab_file", "merge_file", "hf_config")
# What a PEFT file (launcher_scripts/jobs/fine_tuning/peft_file.py) holds instead of CONFIG.
PEFT_CONFIG = "peft_config.yaml"


@dataclass
class Portable:
    config: DictConfig  # tokenizer paths made absolute where the file was extracted
    tensors: TensorFile  # a mapping that reads each tensor when asked for it


def write(path: Path, model_config: DictConfig, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Write the tar atomically (a temporary name, then rename). Returns its member names."""
    from launcher_scripts.formats.safetensors_stream import StreamedTensor

    return write_streamed(
        path, model_config, [StreamedTensor.whole(k, t) for k, t in tensors.items()]
    )


def write_streamed(
    path: Path, model_config: DictConfig, tensors: Iterable[StreamedTensor]
) -> list[str]:
    """write() for tensors made one piece at a time (an import from a checkpoint larger than
    memory): only the piece being written is held."""
    from launcher_scripts.formats import safetensors_stream

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
        safetensors_stream.write(weights, tensors)
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
    """The model config of a whole, self-consistent portable file, without reading the weights:
    ValueError (portable_check.PortableFileError, one line saying what is wrong) otherwise."""
    from launcher_scripts.formats.portable_check import inspect_portable

    return inspect_portable(path).config


def tokenizer_digest(path: Path) -> str:
    """A digest of the tokenizer files a portable file holds: equal exactly when two files
    tokenize alike."""
    import hashlib

    digest = hashlib.sha256()
    with tarfile.open(path) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.isfile() and member.name.startswith(f"{TOKENIZER_DIR}/"):
                data = tar.extractfile(member)
                digest.update(member.name.encode() + b"\0")
                digest.update(data.read() if data is not None else b"")
    return digest.hexdigest()


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


def read(path: Path, workdir: Path, extract: bool = True) -> Portable:
    """Open the tar: tokenizer files are extracted under `workdir` (with extract=False: they
    are there already, another process extracted them); the tensors are read from the file in
    place, each when it is asked for (a rank reads its own layers, not the whole model)."""
    from launcher_scripts.formats.safetensors_stream import TensorFile

    with tarfile.open(path) as tar:
        config = _config(tar, path)
        try:
            weights = tar.getmember(WEIGHTS)
        except KeyError:
            raise ValueError(f"{path} is not a portable checkpoint (no {WEIGHTS})") from None
        members = [m for m in tar.getmembers() if m.name.startswith(f"{TOKENIZER_DIR}/")]
        if extract:
            tar.extractall(workdir, members=members, filter="data")
    for key in TOKENIZER_KEYS:
        value = config.tokenizer.get(key)
        if value:
            config.tokenizer[key] = str(workdir / str(value))
    return Portable(config, TensorFile(path, weights.offset_data, weights.size))
