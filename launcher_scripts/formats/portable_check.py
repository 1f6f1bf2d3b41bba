"""Validate a portable `.nemo` file (portable.py) or a PEFT file (fine_tuning/peft_file.py)
without loading its weights: the one check every reader of these files makes first.

What is checked, reading only the tar headers, the model config and the safetensors header:
  - the file is a tar archive, and no member runs past the end of the file (truncated copies);
  - the config and weights members are there;
  - the weights member is a safetensors file whose header is valid JSON and whose tensors
    exactly fill the member (a weights file cut short is caught here too);
  - for a model file, the tensor shapes agree with model_config.yaml (hidden size, layers,
    heads, query groups, kv channels, FFN size, position embeddings).

Failures raise PortableFileError with one line that names the file and what is wrong; stages
turn it into a ConfigError naming their key (`require_portable`). Torch-free, and it reads a
few kilobytes, so a preflight may call it for every file it is given.
"""

from __future__ import annotations

import json
import os
import struct
import tarfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from omegaconf import DictConfig, OmegaConf

from launcher_scripts.errors import ConfigError, LauncherError
from launcher_scripts.formats.portable import CONFIG as MODEL_CONFIG
from launcher_scripts.formats.portable import PEFT_CONFIG, TOKENIZER_DIR, TOKENIZER_KEYS
from launcher_scripts.formats.portable import WEIGHTS as MODEL_WEIGHTS

PEFT_WEIGHTS = "peft_weights.safetensors"  # peft_file.WEIGHTS
# A safetensors header is JSON of a few KB per hundred tensors; a larger length prefix means
# the bytes are not a safetensors file.
MAX_HEADER_BYTES = 100 << 20
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8,
}  # fmt: skip
# Megatron's gated-linear-unit activations: fc1 produces value and gate, 2 x ffn columns.
GATED_ACTIVATIONS = (
    *("swiglu", "fast-swiglu", "geglu", "fast-geglu", "reglu", "fast-reglu"),
    "geglu-tanh",  # an imported T5 v1.1's or mT5's
)


class PortableFileError(ValueError):
    """The file is not a readable portable/PEFT file: one line naming it and the problem."""


@dataclass(frozen=True)
class PortableSummary:
    config: DictConfig  # the file's config (model_config.yaml or peft_config.yaml)
    shapes: dict[str, tuple[int, ...]]  # every tensor's shape, from the safetensors header


def inspect_portable(path: str | Path) -> PortableSummary:
    """A portable model file's config and tensor shapes, checked to agree, with the tokenizer
    files its config names."""
    members = _members(Path(path), "a portable model file")
    if PEFT_CONFIG in members and MODEL_CONFIG not in members:
        raise PortableFileError(
            f"{path} is a PEFT file (only the tuned tensors, not a whole model): merge it "
            "into its base model first (python3 -m launcher_scripts merge-lora BASE PEFT "
            "OUT) or give the base model"
        )
    summary = _inspect(Path(path), MODEL_CONFIG, MODEL_WEIGHTS, "a portable model file", members)
    check_shapes(Path(path), summary.config, summary.shapes)
    tokenizer = summary.config.get("tokenizer") or {}
    for key in TOKENIZER_KEYS:
        member = str(tokenizer.get(key) or "")
        if member.startswith(f"{TOKENIZER_DIR}/") and member not in members:
            raise PortableFileError(f"{path} has no {member} (its tokenizer.{key}): cut short?")
    return summary


def inspect_peft(path: str | Path) -> PortableSummary:
    """A PEFT file's config and tensor shapes."""
    return _inspect(Path(path), PEFT_CONFIG, PEFT_WEIGHTS, "a PEFT file")


def require_portable(path: str | Path, key: str, fix: str | None = None) -> DictConfig:
    """inspect_portable for a preflight: ConfigError naming `key` when the file is bad."""
    try:
        return inspect_portable(path).config
    except PortableFileError as error:
        raise ConfigError(
            key, str(error), fix or "Give the .nemo file the conversion stage writes"
        ) from None


def require_peft(path: str | Path, key: str) -> DictConfig:
    try:
        return inspect_peft(path).config
    except PortableFileError as error:
        raise ConfigError(key, str(error), "Give the .nemo file the peft stage wrote") from None


def _inspect(
    path: Path,
    config_name: str,
    weights_name: str,
    kind: str,
    members: dict[str, tarfile.TarInfo] | None = None,
) -> PortableSummary:
    members = members if members is not None else _members(path, kind)
    for name in (config_name, weights_name):
        if name not in members:
            raise PortableFileError(f"{path} is not {kind}: it has no {name}")
    try:
        with tarfile.open(path) as tar:
            config = _read_config(tar, members[config_name], path, kind)
            weights = tar.extractfile(members[weights_name])
            assert weights is not None
            shapes = _safetensors_shapes(weights, members[weights_name].size, path)
    except (OSError, EOFError, tarfile.TarError) as error:
        raise PortableFileError(f"{path} cannot be read ({_first_line(error)})") from None
    return PortableSummary(config, shapes)


def _members(path: Path, kind: str) -> dict[str, tarfile.TarInfo]:
    """The tar's members by name, each checked to lie within the file."""
    try:
        size = os.stat(path).st_size
        with tarfile.open(path) as tar:
            members = tar.getmembers()
    except FileNotFoundError:
        raise PortableFileError(f"{path} does not exist") from None
    except (OSError, EOFError, tarfile.TarError) as error:
        if "unexpected end" in str(error):
            raise PortableFileError(
                f"{path} is truncated: the archive ends inside a member (an interrupted copy "
                "or download?)"
            ) from None
        raise PortableFileError(
            f"{path} is not {kind}: not a tar archive ({_first_line(error).rstrip(':')}); it "
            "may be cut short or another kind of file"
        ) from None
    if not members:
        raise PortableFileError(f"{path} is not {kind}: an empty archive")
    for member in members:
        end = member.offset_data + member.size
        if end > size:
            raise PortableFileError(
                f"{path} is truncated: its member {member.name} ends at byte {end} but the "
                f"file has {size} bytes (an interrupted copy or download?)"
            )
    return {member.name: member for member in members}


def _read_config(
    tar: tarfile.TarFile, member: tarfile.TarInfo, path: Path, kind: str
) -> DictConfig:
    stream = tar.extractfile(member)
    assert stream is not None
    try:
        config = OmegaConf.create(stream.read().decode("utf-8"))
    except Exception as error:  # YAML and decoding errors have many types
        raise PortableFileError(
            f"{path} is not {kind}: its {member.name} is not readable YAML ({_first_line(error)})"
        ) from None
    if not isinstance(config, DictConfig):
        raise PortableFileError(f"{path} is not {kind}: its {member.name} is not a mapping")
    return config


def _safetensors_shapes(stream: IO[bytes], size: int, path: Path) -> dict[str, tuple[int, ...]]:
    """The tensors' shapes from a safetensors header, checked to fill the member exactly."""
    prefix = stream.read(8)
    if len(prefix) < 8:
        raise PortableFileError(f"{path}: its weights are cut short (no safetensors header)")
    (length,) = struct.unpack("<Q", prefix)
    if length > min(size - 8, MAX_HEADER_BYTES):
        raise PortableFileError(f"{path}: its weights are not a safetensors file")
    try:
        header = json.loads(stream.read(length))
    except (ValueError, UnicodeDecodeError):
        raise PortableFileError(f"{path}: its weights have a damaged safetensors header") from None
    if not isinstance(header, dict):
        raise PortableFileError(f"{path}: its weights have a damaged safetensors header")
    shapes: dict[str, tuple[int, ...]] = {}
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            shape = tuple(int(n) for n in entry["shape"])
            begin, stop = (int(n) for n in entry["data_offsets"])
            itemsize = DTYPE_BYTES[entry["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise PortableFileError(
                f"{path}: its weights have a damaged safetensors header (tensor {name})"
            ) from None
        count = 1
        for n in shape:
            count *= n
        if stop - begin != count * itemsize or begin < 0:
            raise PortableFileError(f"{path}: tensor {name} has a damaged size in its header")
        shapes[name] = shape
        end = max(end, stop)
    data = size - 8 - length
    if end != data:
        raise PortableFileError(
            f"{path}: its weights hold {data} bytes of tensor data but the header describes "
            f"{end} (truncated or damaged)"
        )
    return shapes


def expected_shapes(config: Mapping[str, Any]) -> dict[str, tuple[tuple[int | None, ...], str]]:
    """What model_config.yaml says each GPT tensor's shape is (None: any size, e.g. the
    padded vocabulary), with the config keys that say it. Layer tensors are stacked over the
    layers (portable.py)."""
    hidden = int(config["hidden_size"])
    layers = int(config["num_layers"])
    heads = int(config["num_attention_heads"])
    groups = int(config.get("num_query_groups") or heads)
    channels = int(config.get("kv_channels") or hidden // heads)
    ffn = int(config["ffn_hidden_size"])
    gated = 2 if str(config.get("activation", "gelu")) in GATED_ACTIVATIONS else 1
    attention = "num_attention_heads, num_query_groups, kv_channels"
    shapes: dict[str, tuple[tuple[int | None, ...], str]] = {
        "embedding.word_embeddings.weight": ((None, hidden), "hidden_size"),
        "decoder.layers.self_attention.linear_qkv.weight": (
            (layers, (heads + 2 * groups) * channels, hidden),
            f"num_layers, {attention}, hidden_size",
        ),
        "decoder.layers.self_attention.linear_proj.weight": (
            (layers, hidden, heads * channels),
            f"num_layers, hidden_size, {attention}",
        ),
        "decoder.layers.mlp.linear_fc1.weight": (
            (layers, gated * ffn, hidden),
            "num_layers, ffn_hidden_size, activation, hidden_size",
        ),
        "decoder.layers.mlp.linear_fc2.weight": (
            (layers, hidden, ffn),
            "num_layers, hidden_size, ffn_hidden_size",
        ),
        "output_layer.weight": ((None, hidden), "hidden_size"),
    }
    if config.get("position_embedding_type", "learned_absolute") == "learned_absolute":
        shapes["embedding.position_embeddings.weight"] = (
            (int(config["max_position_embeddings"]), hidden),
            "max_position_embeddings, hidden_size",
        )
    return shapes


REQUIRED_TENSORS: Sequence[str] = (
    "embedding.word_embeddings.weight",
    "decoder.layers.self_attention.linear_qkv.weight",
)
ShapeTable = Callable[[Mapping[str, Any]], dict[str, tuple[tuple[int | None, ...], str]]]
# model_family -> what its model_config.yaml says its tensors' shapes are, registered by the
# families (launcher_scripts.families, above this package) when their package is imported; a
# family without one gets the file-level checks only. A file without model_family comes from
# a version that converted decoder stacks only.
SHAPE_TABLES: dict[str, ShapeTable] = {}


def check_shapes(path: Path, config: DictConfig, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """The weights' shapes agree with the config (the first disagreement raises)."""
    family = config.get("model_family")
    if family is not None and not SHAPE_TABLES:
        # Skipping the check without a word would pass a file whose config and weights
        # disagree: the program has to import launcher_scripts.families first.
        raise LauncherError(
            f"{path}: no model family has registered its tensor shapes: import "
            "launcher_scripts.families before checking a portable file (a bug: please report it)"
        )
    table = expected_shapes if family is None else SHAPE_TABLES.get(str(family))
    if table is None:
        return
    try:
        expected = table(config)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        raise PortableFileError(
            f"{path}: its {MODEL_CONFIG} lacks or garbles a model size ({_first_line(error)})"
        ) from None
    for name in REQUIRED_TENSORS:
        # A stack of unlike layers (dense and MoE) keeps each layer's tensors apart.
        if name not in shapes and name.replace(".layers.", ".layers.0.") not in shapes:
            raise PortableFileError(f"{path} is not a portable model file: no tensor {name}")
    for name, (wanted, keys) in expected.items():
        actual = shapes.get(name)
        if actual is None:
            continue
        if len(actual) != len(wanted) or any(
            w is not None and w != a for w, a in zip(wanted, actual, strict=True)
        ):
            shown = tuple("*" if w is None else w for w in wanted)
            raise PortableFileError(
                f"{path}: its {MODEL_CONFIG} and weights disagree: {name} has shape "
                f"{list(actual)} but the config's {keys} give {list(shown)}. Convert the "
                "checkpoint again, or restore the file's own model_config.yaml"
            )


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
