"""Small preflight checks that name the key, say what is wrong and how to fix it."""

from __future__ import annotations

import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

from launcher_scripts.errors import ConfigError


def require_file(key: str, path: Any, secret: bool = False) -> Path:
    """An existing, non-empty regular file.

    `secret`: the file holds a secret, so its path is left out of the errors: a secret pasted
    where its file's path belongs must not be printed back (into terminals, CI logs).
    """
    if path in (None, ""):
        raise ConfigError(key, "is not set", f"Set {key}=/path/to/file")
    file = Path(str(path))
    shown = "the file it names (not shown: it may be the secret itself)" if secret else str(file)
    if not file.exists():
        fix = "Give the path of the file holding the secret" if secret else "Fix the path"
        raise ConfigError(key, f"{shown} does not exist", f"{fix} or create the file")
    if not file.is_file():
        raise ConfigError(key, f"{shown} is not a file", "Give the path of a file")
    if file.stat().st_size == 0:
        raise ConfigError(key, f"{shown} is empty", "Give a file with content")
    return file


def require_input(key: str, path: Any, suffixes: Collection[str]) -> Path:
    """A data file with one of `suffixes`, or a directory holding at least one file."""
    if path in (None, ""):
        raise ConfigError(key, "is not set", f"Set {key} to a data file or folder")
    source = Path(str(path))
    if source.is_dir():
        if not any(p.is_file() for p in source.rglob("*")):
            raise ConfigError(key, f"folder {source} holds no files", "Put text files in it")
        return source
    if not any(source.name.endswith(suffix) for suffix in suffixes):
        raise ConfigError(
            key,
            f"{source.name} is not a supported input",
            f"Use a folder of text files or a file ending in {', '.join(sorted(suffixes))}",
        )
    return require_file(key, source)


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def require_env_name(key: str, name: Any) -> str:
    """A name a shell can export (scripts write `export NAME=...` with it as it is)."""
    text = str(name)
    if not ENV_NAME.fullmatch(text):
        raise ConfigError(
            key,
            f"{text!r} is not an environment variable name",
            "Use letters, digits and _, not starting with a digit",
        )
    return text


def require_choice(key: str, value: Any, choices: Collection[str]) -> None:
    if value not in choices:
        raise ConfigError(key, f"{value!r} is not valid", f"Use one of: {', '.join(choices)}")


def require_int(key: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(key, f"{value!r} is not an integer >= {minimum}", "Fix the value")
    return value


def require_fraction(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ConfigError(key, f"{value!r} is not a number between 0 and 1", "Fix the value")
    return float(value)


def require_open_fraction(key: str, value: Any) -> float:
    """A threshold strictly between 0 and 1 (at either end it keeps or removes everything)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise ConfigError(
            key, f"{value!r} is not a number strictly between 0 and 1", "Give e.g. 0.8"
        )
    return float(value)


def heads_split_problem(tensor: int, heads: int, query_groups: int | None = None) -> str | None:
    """Why tensor parallelism of `tensor` ranks cannot give each rank whole attention heads and
    whole query groups (key-value heads; None: one per head), or None when it can."""
    if heads % tensor:
        return f"{tensor} does not divide the {heads} attention heads"
    if query_groups is not None and query_groups % tensor:
        return f"{tensor} does not divide the {query_groups} query groups (key-value heads)"
    return None


def splits_heads(tensor: int, heads: int, query_groups: int | None = None) -> bool:
    return heads_split_problem(tensor, heads, query_groups) is None


def require_heads_split(
    key: str,
    tensor: int,
    heads: int,
    query_groups: int | None = None,
    groups_key: str | None = None,
) -> None:
    """ConfigError naming `key` (`groups_key`, when given, for the query groups) unless TP
    splits the heads and query groups evenly (heads_split_problem)."""
    problem = heads_split_problem(tensor, heads, query_groups)
    if problem is None:
        return
    if heads % tensor:
        raise ConfigError(key, problem, "Choose a TP that divides the number of heads")
    raise ConfigError(
        groups_key or key, problem, "Choose a TP that divides the number of query groups"
    )


def require_layout(model: Any, tensor: int, pipeline: int, key_prefix: str) -> None:
    """TP must divide the model's attention heads and PP its layers (each block's, in an
    encoder-decoder's section); the error names `<key_prefix>.tensor_model_parallel_size` or
    `...pipeline_model_parallel_size`."""
    blocks = [model[name] for name in ("encoder", "decoder") if name in model]
    for block in blocks:
        require_layout(block, tensor, pipeline, key_prefix)
    if blocks:
        return
    groups = model.get("num_query_groups")
    require_heads_split(
        f"{key_prefix}.tensor_model_parallel_size",
        tensor,
        int(model.num_attention_heads),
        None if groups is None else int(groups),
    )
    if int(model.num_layers) % pipeline:
        raise ConfigError(
            f"{key_prefix}.pipeline_model_parallel_size",
            f"{pipeline} does not divide the model's {model.num_layers} layers",
            "Use a divisor of the layer count",
        )


def require_row_split(rows: int, tensor: int, key_prefix: str, whose: str) -> None:
    """TP must divide a model's embedding (vocabulary) rows, which tensor parallelism splits;
    `whose` names the model, e.g. "the model's" or "the file's"."""
    if rows % tensor:
        raise ConfigError(
            f"{key_prefix}.tensor_model_parallel_size",
            f"{tensor} does not divide {whose} {rows} embedding rows",
            "Use a divisor of the row count",
        )


def require_position_embedding(key: str, value: Any, allowed: Collection[str]) -> None:
    """A position embedding the model family builds. ALiBi (NeMo's changelog, for T5 and GPT)
    is said by name: megatron-core's models have no ALiBi attention bias."""
    if value == "alibi":
        raise ConfigError(
            key,
            "'alibi' is not implemented: megatron-core's GPT, T5 and BERT models add no ALiBi "
            "attention bias",
            f"Use one of: {', '.join(allowed)}",
        )
    require_choice(key, value, allowed)


def require_each_choice(key: str, values: Any, choices: Collection[str], noun: str) -> None:
    """Every item of a list is one of `choices`; the first that is not is named by its index
    (`key[i]`), as "'x' is not a <noun>"."""
    for index, value in enumerate(values):
        if value not in choices:
            raise ConfigError(
                f"{key}[{index}]", f"{value!r} is not {noun}", f"Use some of: {', '.join(choices)}"
            )
