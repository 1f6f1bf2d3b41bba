"""Hugging Face model directories altered the way broken downloads and hand edits alter them:
a copy of a tiny model's directory (links to its files) with one thing changed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

# An alteration of a copied directory (its files are links: replace, do not write through).
Alteration = Callable[[Path], None]


def altered(source: Path, target: Path, *alterations: Alteration) -> Path:
    """`target`: links to each of `source`'s files, then each alteration applied."""
    target.mkdir(parents=True)
    for path in source.iterdir():
        (target / path.name).symlink_to(path)
    for alteration in alterations:
        alteration(target)
    return target


def _replace(path: Path, data: bytes | str) -> None:
    path.unlink()
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_bytes(data)


def config(**fields: object) -> Alteration:
    """config.json with these fields set."""

    def alter(directory: Path) -> None:
        settings = json.loads((directory / "config.json").read_text())
        _replace(directory / "config.json", json.dumps(settings | fields))

    return alter


def without_tensor(name: str) -> Alteration:
    """model.safetensors without the tensor `name`."""

    def alter(directory: Path) -> None:
        from safetensors.numpy import load_file, save

        tensors = load_file(directory / "model.safetensors")
        del tensors[name]
        _replace(directory / "model.safetensors", save(tensors))

    return alter


def corrupt(name: str) -> Alteration:
    """The file `name` cut to its first bytes (a download stopped early)."""

    def alter(directory: Path) -> None:
        _replace(directory / name, (directory / name).read_bytes()[:40])

    return alter


def more_tokens(count: int) -> Alteration:
    """tokenizer.json with `count` tokens added past its own."""

    def alter(directory: Path) -> None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        tokenizer.add_tokens([f"<added_{i}>" for i in range(count)])
        _replace(directory / "tokenizer.json", tokenizer.to_str())

    return alter


def replaced_by(name: str, source: Path) -> Alteration:
    """The file `name` replaced by a link to `source` (another model's)."""

    def alter(directory: Path) -> None:
        (directory / name).unlink()
        (directory / name).symlink_to(source)

    return alter


MISSING_SHARD = "model-00002-of-00002.safetensors"


def sharded_without_its_second_shard(directory: Path) -> None:
    """model.safetensors as the first of two shards an index names; the second not there."""
    from safetensors import safe_open

    first = "model-00001-of-00002.safetensors"
    (directory / "model.safetensors").rename(directory / first)
    with safe_open(directory / first, "numpy") as shard:
        names = sorted(shard.keys())
    half = len(names) // 2
    weight_map = {n: first for n in names[:half]} | {n: MISSING_SHARD for n in names[half:]}
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
