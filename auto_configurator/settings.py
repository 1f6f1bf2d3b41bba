"""`search_config.train_settings` as typed values, each checked with a one-line error.

A search key is `auto` (the search picks the values) or a list; `auto` is kept as None here
and the search space (candidates.py) fills it in from the model and the cluster.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher_scripts.errors import ConfigError
from launcher_scripts.families import model_types

AUTO = "auto"
PREFIX = "search_config.train_settings"
RECOMPUTE_CHOICES = {
    "0": None,
    "none": None,
    "null": None,
    "selective": "selective",
    "full": "full",
}


@dataclass(frozen=True)
class TrainSettings:
    family: str  # gpt3 | t5 | mt5 | bert, from the search config's folder
    model_size_in_b: float | None  # None: recommend one
    num_nodes: int
    gpus_per_node: int
    gpu_memory_gb: float
    max_training_days: float
    limit_search_runs: int
    output_top_n: int
    max_steps_per_run: int
    max_minutes_per_run: float
    tflops_per_gpu: float
    num_tokens_in_b: float
    vocab_size: int
    seq_length: int
    logs: Path
    base_recipe: str
    # Search space: None means auto.
    tensor_parallel_sizes: tuple[int, ...] | None
    pipeline_parallel_sizes: tuple[int, ...] | None
    virtual_pipeline_sizes: tuple[int | None, ...] | None
    context_parallel_sizes: tuple[int, ...] | None
    expert_parallel_sizes: tuple[int, ...] | None  # a mixture of experts'; None: auto
    micro_batch_sizes: tuple[int, ...] | None
    recompute: tuple[str | int | None, ...] | None  # from act_ckpt_layers
    sequence_parallel: tuple[bool, ...] | None
    min_model_parallel_size: int | None
    max_model_parallel_size: int | None
    global_batch_size: int | None
    memory_safety_margin: float
    warmup_steps_per_run: int

    @property
    def gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def memory_limit_bytes(self) -> float:
        """What a layout may use per GPU: the GPU's memory less the safety margin."""
        return self.gpu_memory_gb * 2**30 * (1 - self.memory_safety_margin)


def family_of(search_config_value: str | None) -> str:
    family = str(search_config_value or "").split("/")[0]
    if family not in model_types():
        raise ConfigError(
            "search_config",
            f"{search_config_value!r} is not under one of the model folders",
            f"Use a search config under {', '.join(f'search_config/{f}/' for f in model_types())}",
        )
    return family


def parse(search_config_value: str | None, train: Mapping[str, Any]) -> TrainSettings:
    """Typed and checked train settings; `train` is the resolved `train_settings` mapping."""
    reader = _Reader(train)
    min_mp = reader.auto_int("min_model_parallel_size")
    max_mp = reader.auto_int("max_model_parallel_size")
    if min_mp is not None and max_mp is not None and min_mp > max_mp:
        raise ConfigError(
            f"{PREFIX}.min_model_parallel_size",
            f"{min_mp} is above max_model_parallel_size {max_mp}",
            "Lower it, raise the maximum, or set both to auto",
        )
    margin = reader.number("memory_safety_margin", default=0.1, allow_zero=True)
    if margin >= 1:
        raise ConfigError(
            f"{PREFIX}.memory_safety_margin",
            f"{margin} leaves no memory",
            "Use a fraction below 1, e.g. 0.1",
        )
    size = train.get("model_size_in_b")
    return TrainSettings(
        family=family_of(search_config_value),
        model_size_in_b=None if size is None else reader.number("model_size_in_b"),
        num_nodes=reader.positive_int("num_nodes"),
        gpus_per_node=reader.positive_int("gpus_per_node"),
        gpu_memory_gb=reader.number("gpu_memory_gb"),
        max_training_days=reader.number("max_training_days"),
        limit_search_runs=reader.positive_int("limit_search_runs"),
        output_top_n=reader.positive_int("output_top_n"),
        max_steps_per_run=reader.positive_int("max_steps_per_run"),
        max_minutes_per_run=reader.number("max_minutes_per_run"),
        tflops_per_gpu=reader.number("tflops_per_gpu"),
        num_tokens_in_b=reader.number("num_tokens_in_b"),
        vocab_size=reader.positive_int("vocab_size"),
        seq_length=reader.positive_int("seq_length", default=2048),
        logs=Path(str(reader.required("logs"))).absolute(),
        base_recipe=str(reader.required("base_recipe")),
        tensor_parallel_sizes=reader.auto_ints("tensor_parallel_sizes"),
        pipeline_parallel_sizes=reader.auto_ints("pipeline_parallel_sizes"),
        virtual_pipeline_sizes=reader.auto_ints("virtual_pipeline_sizes", allow_null=True),
        context_parallel_sizes=reader.auto_ints("context_parallel_sizes"),
        expert_parallel_sizes=reader.auto_ints("expert_parallel_sizes"),
        micro_batch_sizes=reader.auto_ints("micro_batch_sizes"),
        recompute=reader.recompute("act_ckpt_layers"),
        sequence_parallel=reader.auto_bools("sequence_parallel"),
        min_model_parallel_size=min_mp,
        max_model_parallel_size=max_mp,
        global_batch_size=reader.auto_int("global_batch_size"),
        memory_safety_margin=margin,
        warmup_steps_per_run=reader.int_at_least("warmup_steps_per_run", 0, default=5),
    )


class _Reader:
    """Reads one key of train_settings at a time, naming the key in every error."""

    def __init__(self, train: Mapping[str, Any]) -> None:
        self.train = train

    def key(self, name: str) -> str:
        return f"{PREFIX}.{name}"

    def required(self, name: str) -> Any:
        value = self.train.get(name)
        if value is None:
            raise ConfigError(self.key(name), "is not set", f"Set {self.key(name)}=...")
        return value

    def number(self, name: str, default: float | None = None, allow_zero: bool = False) -> float:
        value = self.train.get(name, default) if default is not None else self.required(name)
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if not numeric or value < 0 or (value == 0 and not allow_zero):
            wanted = "a number >= 0" if allow_zero else "a positive number"
            raise ConfigError(self.key(name), f"{value!r} is not {wanted}", f"Give {wanted}")
        return float(value)

    def int_at_least(self, name: str, minimum: int, default: int | None = None) -> int:
        value = self.train.get(name, default) if default is not None else self.required(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(
                self.key(name),
                f"{value!r} is not an integer >= {minimum}",
                f"Give an integer of at least {minimum}",
            )
        return value

    def positive_int(self, name: str, default: int | None = None) -> int:
        return self.int_at_least(name, 1, default)

    def auto_int(self, name: str) -> int | None:
        value = self.train.get(name, AUTO)
        if value in (AUTO, None):
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                self.key(name), f"{value!r} is neither auto nor a positive integer", "Fix it"
            )
        return value

    def _values(self, name: str) -> list[Any] | None:
        value = self.train.get(name, AUTO)
        if value == AUTO:
            return None
        values = list(value) if isinstance(value, list | tuple) else [value]
        if not values:
            raise ConfigError(self.key(name), "is an empty list", "Give auto or a list of values")
        return values

    def auto_ints(self, name: str, allow_null: bool = False) -> tuple[Any, ...] | None:
        values = self._values(name)
        if values is None:
            return None
        for value in values:
            if value is None and allow_null:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                example = "[null, 2, 4]" if allow_null else "[1, 2, 4, 8]"
                raise ConfigError(
                    self.key(name),
                    f"{value!r} is not a positive integer",
                    f"Give auto or a list such as {example}",
                )
        # null and 1 both mean no interleaving; keep one of them.
        cleaned = [None if allow_null and v == 1 else v for v in values]
        return tuple(dict.fromkeys(cleaned))

    def auto_bools(self, name: str) -> tuple[bool, ...] | None:
        values = self._values(name)
        if values is None:
            return None
        if not all(isinstance(v, bool) for v in values):
            raise ConfigError(
                self.key(name), f"{values!r} holds a non-boolean", "Give auto, [true], [false]"
            )
        return tuple(dict.fromkeys(values))

    def recompute(self, name: str) -> tuple[str | int | None, ...] | None:
        """act_ckpt_layers: 0 (none), N > 0 (full recomputation of the first N layers of each
        pipeline stage, as NeMo counts them), selective, or full (every layer)."""
        values = self._values(name)
        if values is None:
            return None
        choices: list[str | int | None] = []
        for value in values:
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                choices.append(value)
                continue
            text = "null" if value is None else str(value).lower()
            if text not in RECOMPUTE_CHOICES:
                raise ConfigError(
                    self.key(name),
                    f"{value!r} is not a recomputation choice",
                    "Give auto or a list of 0, a number of layers, selective, full",
                )
            choices.append(RECOMPUTE_CHOICES[text])
        return tuple(dict.fromkeys(choices))
