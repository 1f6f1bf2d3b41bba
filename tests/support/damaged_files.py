"""Damaged copies of real files, as users end up with them: cut short by an interrupted copy,
replaced by something else, or with a config edited away from its weights."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf


def cut(source: Path, target: Path, keep: int) -> Path:
    """The first `keep` bytes of `source` (negative: all but the last -keep)."""
    data = source.read_bytes()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data[:keep])
    return target


def member_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Each tar member's data start and end in the file."""
    with tarfile.open(path) as tar:
        return {m.name: (m.offset_data, m.offset_data + m.size) for m in tar.getmembers()}


def damaged_tars(source: Path, folder: Path) -> dict[str, Path]:
    """Copies of the tar `source` (a .nemo or PEFT file) damaged in each way that matters,
    by the way they are damaged."""
    folder.mkdir(parents=True, exist_ok=True)
    offsets = member_offsets(source)
    weights = next(name for name in offsets if name.endswith(".safetensors"))
    start, end = offsets[weights]
    files = {
        "cut in the weights": cut(source, folder / "cut-weights.nemo", (start + end) // 2),
        "cut in the safetensors header": cut(source, folder / "cut-header.nemo", start + 20),
        "cut after the config": cut(source, folder / "cut-config.nemo", start - 300),
        "cut to a few bytes": cut(source, folder / "cut-short.nemo", 100),
        "empty": cut(source, folder / "empty.nemo", 0),
    }
    garbage = folder / "garbage.nemo"
    garbage.write_bytes(os.urandom(50_000))
    files["garbage"] = garbage
    text = folder / "text.nemo"
    text.write_text("model_config: this is not a tar\n")
    files["a text file"] = text
    files["no weights"] = without_member(source, folder / "no-weights.nemo", weights)
    return files


def without_member(source: Path, target: Path, name: str) -> Path:
    with tarfile.open(source) as tar, tarfile.open(target, "w") as out:
        for member in tar.getmembers():
            if member.name != name:
                out.addfile(member, tar.extractfile(member))
    return target


def with_config(source: Path, target: Path, **changes: Any) -> Path:
    """A copy of the portable file `source` whose model_config.yaml has `changes`."""
    with tarfile.open(source) as tar, tarfile.open(target, "w") as out:
        for member in tar.getmembers():
            stream = tar.extractfile(member)
            if member.name == "model_config.yaml":
                assert stream is not None
                config = OmegaConf.create(stream.read().decode())
                for key, value in changes.items():
                    config[key] = value
                data = OmegaConf.to_yaml(config).encode()
                member.size = len(data)
                stream = io.BytesIO(data)
            out.addfile(member, stream)
    return target
