"""`search_config.inference_settings` as typed values, each checked with a one-line error, and
the portable model file the inference search measures, checked against them.

The keys are the NeMo launcher's (`run.*`, `benchmark.*`); beyond them: `run.model_file` (the
conversion stage's file of `model_train_name` by default), `run.serve_with_triton`,
`benchmark.repeats` and `benchmark.max_latency_ms`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher_scripts.config.checks import splits_heads
from launcher_scripts.errors import ConfigError
from launcher_scripts.families import model_types, of_model_type
from launcher_scripts.recipes.precision import PRECISIONS

PREFIX = "search_config.inference_settings"
DATA_TYPES = ("fp32", "fp16", "bf16")
TRITON_CHOICES = {"auto": None, True: True, False: False}


@dataclass(frozen=True)
class ModelFacts:
    """What the search needs to know of the portable file, read without its weights."""

    num_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    data_type: str  # the precision the runner builds it in: fp32 | fp16 | bf16


@dataclass(frozen=True)
class InferenceSettings:
    model_type: str
    model_train_name: str
    model_file: Path
    gpus_per_node: int  # processes on a machine without GPUs
    data_type: str | None  # None: the model file's own precision
    time_limit_s: int  # each measuring step (a runner launch, the export, a server session)
    results_dir: Path  # the search writes <results_dir>/inference/
    tensor_parallel_sizes: tuple[int, ...]
    pipeline_parallel_sizes: tuple[int, ...]
    serve_with_triton: bool | None  # None: when a Triton server is installed
    input_len: int
    output_len: int
    batch_sizes: tuple[int, ...]
    beam_width: int
    topk: int
    topp: float
    repeats: int
    max_latency_ms: tuple[float, ...]  # latency budgets; () when there is none

    @property
    def folder(self) -> Path:
        return self.results_dir / "inference"


def parse(section: Mapping[str, Any] | None) -> InferenceSettings:
    """Typed and checked settings; `section` is the resolved `inference_settings` mapping."""
    if not isinstance(section, Mapping):
        raise ConfigError(
            PREFIX,
            "is missing from this search config",
            "Use a gpt3 search config (they have inference_settings) or add the section",
        )
    run = _Section(section, "run")
    bench = _Section(section, "benchmark")
    model_type = str(run.required("model_type"))
    served = tuple(t for t in model_types() if of_model_type(t).runs("export"))
    if model_type not in served:
        raise ConfigError(
            run.key("model_type"),
            f"{model_type!r} cannot be served: the export stage serves no such model",
            f"Use one of: {', '.join(served)}",
        )
    data_type = run.get("data_type")
    if data_type is not None and str(data_type) not in DATA_TYPES:
        raise ConfigError(
            run.key("data_type"),
            f"{data_type!r} is not a data type",
            f"Use null (the model file's own) or one of: {', '.join(DATA_TYPES)}",
        )
    triton = run.get("serve_with_triton", "auto")
    if triton not in TRITON_CHOICES:
        raise ConfigError(
            run.key("serve_with_triton"), f"{triton!r} is not valid", "Use auto, true or false"
        )
    from launcher_scripts.clusters.base import time_limit_seconds

    budgets = bench.get("max_latency_ms")
    return InferenceSettings(
        model_type=model_type,
        model_train_name=str(run.required("model_train_name")),
        model_file=Path(str(run.required("model_file"))).absolute(),
        gpus_per_node=run.count("gpus_per_node"),
        data_type=None if data_type is None else str(data_type),
        time_limit_s=time_limit_seconds(str(run.required("time_limit")), run.key("time_limit")),
        results_dir=Path(str(run.required("results_dir"))).absolute(),
        tensor_parallel_sizes=run.counts("tensor_parallel_sizes"),
        pipeline_parallel_sizes=run.counts("pipeline_parallel_sizes"),
        serve_with_triton=TRITON_CHOICES[triton],
        input_len=bench.count("input_len"),
        output_len=bench.count("output_len"),
        batch_sizes=bench.counts("batch_sizes"),
        beam_width=bench.count("beam_width"),
        topk=bench.count("topk", minimum=0),
        topp=bench.fraction("topp"),
        repeats=bench.count("repeats", default=3),
        max_latency_ms=() if budgets is None else bench.numbers("max_latency_ms"),
    )


def read_model(settings: InferenceSettings) -> ModelFacts:
    """The model file's shape and precision, checked against every layout and the lengths."""
    key = f"{PREFIX}.run.model_file"
    path = settings.model_file
    if not path.is_file():
        raise ConfigError(
            key,
            f"{path} does not exist",
            "Convert the trained model first (the launcher's conversion stage), or point "
            "model_file at a portable .nemo file",
        )
    from launcher_scripts.formats.portable_check import require_portable

    config = require_portable(
        path, key, "Give the .nemo file the launcher's conversion stage writes"
    )
    precision = str(config.get("precision", 32))
    if precision not in PRECISIONS:
        raise ConfigError(
            key,
            f"{path} records the precision {precision!r}, which the model runner does not build",
            f"Give a model file of one of: {', '.join(PRECISIONS)}",
        )
    facts = ModelFacts(
        num_layers=int(config.num_layers),
        num_attention_heads=int(config.num_attention_heads),
        max_position_embeddings=int(config.max_position_embeddings),
        data_type=PRECISIONS[precision],  # as the runner builds it (recipes.training.precision)
    )
    _check_against(settings, facts)
    return facts


def _check_against(settings: InferenceSettings, facts: ModelFacts) -> None:
    run, bench = f"{PREFIX}.run", f"{PREFIX}.benchmark"
    for tensor in settings.tensor_parallel_sizes:
        if not splits_heads(tensor, facts.num_attention_heads):
            raise ConfigError(
                f"{run}.tensor_parallel_sizes",
                f"TP={tensor} does not divide the model's {facts.num_attention_heads} "
                "attention heads",
                "List only divisors of the head count",
            )
    for pipeline in settings.pipeline_parallel_sizes:
        if facts.num_layers % pipeline:
            raise ConfigError(
                f"{run}.pipeline_parallel_sizes",
                f"PP={pipeline} does not divide the model's {facts.num_layers} layers",
                "List only divisors of the layer count",
            )
    smallest = min(settings.tensor_parallel_sizes) * min(settings.pipeline_parallel_sizes)
    if smallest > settings.gpus_per_node:
        raise ConfigError(
            f"{run}.gpus_per_node",
            f"{settings.gpus_per_node} GPUs hold no layout: the smallest, TP x PP = {smallest}, "
            "needs more",
            "Raise gpus_per_node or list smaller tensor/pipeline parallel sizes",
        )
    total = settings.input_len + settings.output_len
    if total > facts.max_position_embeddings:
        raise ConfigError(
            f"{bench}.input_len",
            f"input_len {settings.input_len} + output_len {settings.output_len} = {total} "
            f"exceeds the model's {facts.max_position_embeddings} positions",
            "Shorten input_len or output_len",
        )
    if settings.data_type is not None and settings.data_type != facts.data_type:
        raise ConfigError(
            f"{run}.data_type",
            f"{settings.data_type} differs from the model file's precision {facts.data_type} "
            "(the served model runs in the precision it was converted in)",
            f"Set data_type to {facts.data_type} or null",
        )


class _Section:
    """One sub-section (run, benchmark) read a key at a time, naming the key in every error."""

    def __init__(self, section: Mapping[str, Any], name: str) -> None:
        value = section.get(name)
        if not isinstance(value, Mapping):
            raise ConfigError(f"{PREFIX}.{name}", "is missing", "Add the section (see gpt3/5b)")
        self.values, self.name = value, name

    def key(self, name: str) -> str:
        return f"{PREFIX}.{self.name}.{name}"

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)

    def required(self, name: str) -> Any:
        value = self.values.get(name)
        if value is None or value == "":
            raise ConfigError(self.key(name), "is not set", f"Set {self.key(name)}=...")
        return value

    def count(self, name: str, minimum: int = 1, default: int | None = None) -> int:
        value = self.values.get(name, default) if default is not None else self.required(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(
                self.key(name),
                f"{value!r} is not an integer >= {minimum}",
                f"Give a whole number of at least {minimum}",
            )
        return value

    def counts(self, name: str) -> tuple[int, ...]:
        value = self.required(name)
        values = list(value) if isinstance(value, list | tuple) else [value]
        if not values or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values
        ):
            raise ConfigError(
                self.key(name),
                f"{value!r} is not a list of positive integers",
                "Give a list such as [1, 2, 4]",
            )
        return tuple(dict.fromkeys(values))

    def fraction(self, name: str) -> float:
        value = self.required(name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
            raise ConfigError(
                self.key(name), f"{value!r} is not a number in [0, 1]", "Give e.g. 0.0 (disabled)"
            )
        return float(value)

    def numbers(self, name: str) -> tuple[float, ...]:
        value = self.values[name]
        values = list(value) if isinstance(value, list | tuple) else [value]
        if not values or any(
            isinstance(v, bool) or not isinstance(v, int | float) or v <= 0 for v in values
        ):
            raise ConfigError(
                self.key(name),
                f"{value!r} is not a positive number or a list of them",
                "Give null, a number such as 1500, or a list such as [500, 1500]",
            )
        return tuple(sorted(float(v) for v in dict.fromkeys(values)))
