#!/usr/bin/env python3
"""`python3 auto_configurator/main.py [estimate ... | KEY=VALUE ...]`: the AutoConfigurator.

Recommends a model size (search_config=<model>/unknown_size), writes a base training config for
the size, and with run_training_hp_search=true measures the most promising parallel layouts
with short training runs through the launcher. `estimate` prints the memory and speed model's
figures for one recipe.
"""

from __future__ import annotations

import difflib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if __package__ in (None, ""):
    # Run as a script: import the package from the checkout, not this folder's modules as
    # top-level ones.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from launcher_scripts.errors import ConfigError, LauncherError

if TYPE_CHECKING:
    from auto_configurator.base_config import BaseConfig
    from auto_configurator.settings import TrainSettings

USAGE = """usage: python3 auto_configurator/main.py [KEY=VALUE ...]
       python3 auto_configurator/main.py estimate [--json] [KEY=VALUE ...]

Compose auto_configurator/conf/config.yaml with Hydra overrides, then: recommend a model size
(model_size_in_b: null), write a base training config, and with run_training_hp_search=true
measure the layouts the memory and throughput model predicts fastest. Examples:
  python3 auto_configurator/main.py search_config=gpt3/unknown_size
  python3 auto_configurator/main.py search_config=gpt3/5b cluster_type=bcm \\
      search_config.train_settings.num_nodes=16 run_training_hp_search=true
  python3 auto_configurator/main.py estimate training=gpt3/5b --json
"""


# The command words, each with its usage; without one, the arguments are overrides.
COMMANDS = {"estimate": "estimate [--json] [KEY=VALUE ...]"}


def is_override(word: str) -> bool:
    """Hydra overrides hold "=" (key=value, +key=value, ~key=value) or start with "~" (~key
    deletes); flags start with "-". Any other word would be a command."""
    return "=" in word or word.startswith(("~", "-"))


def unknown_command(word: str) -> str:
    """The one line for a first word that is neither a command nor an override (Hydra's own
    error is "missing EQUAL")."""
    close = difflib.get_close_matches(word, list(COMMANDS), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    usages = "; ".join(f"python3 auto_configurator/main.py {usage}" for usage in COMMANDS.values())
    return (
        f"error: unknown command {word!r}: {hint}the commands are {', '.join(COMMANDS)} "
        f"({usages}); to recommend a size and search layouts, give KEY=VALUE overrides only"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["estimate"]:
        from auto_configurator import estimate

        return estimate.main(argv[1:])
    if any(arg in ("-h", "--help") for arg in argv):
        print(USAGE)
        return 0
    if argv and not is_override(argv[0]):
        print(unknown_command(argv[0]), file=sys.stderr)
        return 2
    try:
        from auto_configurator.config import compose_config

        return run(compose_config(argv))
    except (LauncherError, OmegaConfBaseException) as error:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        code = error.exit_code if isinstance(error, LauncherError) else 2
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(f"error: {message}", file=sys.stderr)
        return code


def train_settings(cfg: DictConfig) -> dict:
    """search_config.train_settings with every interpolation resolved."""
    try:
        return OmegaConf.to_container(
            cfg.search_config.train_settings, resolve=True, throw_on_missing=True
        )
    except MissingMandatoryValue as error:
        key = f"search_config.train_settings.{error.full_key or ''}".rstrip(".")
        raise ConfigError(key, "has no value (???)", f"Set it: {key}=...") from None


def run(cfg: DictConfig) -> int:
    from auto_configurator import base_config, search, sizing
    from auto_configurator.inference import search as inference_search
    from auto_configurator.settings import parse

    # Checked first: a bad inference setting stops the run before any training search.
    inference = inference_search.prepare(cfg) if cfg.run_inference_hp_search else None
    settings = parse(cfg.search_config_value, train_settings(cfg))
    gpus, tflops = settings.gpus, settings.tflops_per_gpu
    size = settings.model_size_in_b
    if size is None:
        exact = sizing.recommend_size_in_b(
            gpus, tflops, settings.max_training_days, settings.num_tokens_in_b
        )
        size = float(f"{exact:.3g}")
        print(
            f"model size recommendation: {base_config.size_label(size)} parameters "
            f"({gpus} GPUs x {tflops:g} TFLOP/s x {settings.max_training_days:g} days of "
            f"training compute at 6 N D FLOPs for {settings.num_tokens_in_b:g}B tokens)"
        )
    else:
        days = sizing.days_to_train_6nd(size, settings.num_tokens_in_b, gpus, tflops)
        print(
            f"model size {base_config.size_label(size)}: about {days:.3g} days for "
            f"{settings.num_tokens_in_b:g}B tokens on {gpus} GPUs at {tflops:g} TFLOP/s "
            "(6 N D FLOPs)"
        )
    base = base_config.generate(cfg, settings, size)
    describe_base(base, settings)
    code = 0
    if cfg.run_training_hp_search:
        result = search.run(cfg, settings, base)
        code = 0 if result.best is not None else 1
    if inference is not None:
        code = max(code, inference_search.run(cfg, inference))
    return code


def describe_base(base: BaseConfig, settings: TrainSettings) -> None:
    arch = base.architecture
    print(
        f"base config: {base.path}\n"
        f"  {arch.num_layers} layers, hidden {arch.hidden_size}, {arch.num_attention_heads} "
        f"heads, FFN {arch.ffn_hidden_size}: {arch.parameters / 1e9:.3g}B parameters"
    )
    shape = base.model.shape if base.model is not None else None
    experts = getattr(shape, "experts", None)
    if experts is not None:
        # The 6 N D estimate above counts every parameter; a token passes the active ones.
        print(
            f"  {experts.count} experts, each token routed to {experts.top_k}: "
            f"{shape.active_parameters() / 1e9:.3g}B active parameters (the time to train "
            "below counts the FLOPs of these)"
        )
    best = base.best
    if best is not None:
        print(
            f"  layout {best.candidate.label} (the model's predicted fastest that fits): "
            f"{best.memory.total_gib:.1f} GiB per GPU, {best.prediction.step_time_s:.3g} s "
            f"per step, {best.prediction.tflops_per_gpu:.3g} model TFLOP/s per GPU"
        )
    print(
        f"  time to train {settings.num_tokens_in_b:g}B tokens: {base.steps:,} steps, about "
        f"{base.days:.3g} days at {settings.tflops_per_gpu:g} model TFLOP/s per GPU"
        + (
            f" ({base.steps * best.prediction.step_time_s / 86400:.3g} days at the model's "
            "predicted step time)"
            if best is not None
            else ""
        )
    )


if __name__ == "__main__":
    sys.exit(main())
