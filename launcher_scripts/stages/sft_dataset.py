"""SFT datasets of the data_preparation stage: local SQuAD or Dolly-style files converted into
the JSON lines ("input", "output") that the fine-tuning and PEFT recipes read.

One CPU job each, running launcher_scripts.jobs.data_prep.sft_convert (squad: once for the
train file and once for the dev file). The inputs must exist before the run (or be written by
an earlier stage of it); a dry run lists the missing ones instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path

from omegaconf import DictConfig

from launcher_scripts.config.checks import require_fraction, require_int
from launcher_scripts.errors import ConfigError
from launcher_scripts.formats.shards import SPLIT_NAMES
from launcher_scripts.jobspec import Command, JobSpec
from launcher_scripts.stages.base import StageContext, make_job
from launcher_scripts.stages.data_prep_common import JOBS, cpu_resources, stage_key

PROGRAM = f"{JOBS}.sft_convert"


def require_source(ctx: StageContext, name: str, fix: str) -> Path:
    """`<stage>.<name>` is an input file that exists, or that an earlier stage of this run
    writes (in a dry run, any path: it is listed as not there yet). `fix` may name {key}."""
    key, value = stage_key(ctx, name), ctx.cfg.get(name)
    if value in (None, ""):
        raise ConfigError(key, "is not set", f"Set {key}=/path/to/file")
    path = Path(str(value))
    if path.exists():
        if not path.is_file():
            raise ConfigError(key, f"{path} is not a file", "Give the path of a file")
    elif not ctx.will_exist(path):
        raise ConfigError(key, f"{path} does not exist", fix.format(key=key))
    return path


def require_output(ctx: StageContext, name: str, inputs: Mapping[str, Path]) -> Path:
    key, value = stage_key(ctx, name), ctx.cfg.get(name)
    if value in (None, ""):
        raise ConfigError(key, "is not set", f"Set {key}=/path/to/output.jsonl")
    path = Path(str(value))
    for input_name, source in inputs.items():
        if path == source:
            raise ConfigError(
                key, f"is {input_name} too", "Write the output beside the input, not over it"
            )
    return path


def sft_job(
    ctx: StageContext,
    commands: tuple[Command, ...],
    reads: Iterable[Path],
    writes: Iterable[Path],
) -> JobSpec:
    name = str(ctx.cfg.run.name)
    return make_job(
        ctx,
        f"{name}-convert",
        commands,
        cpu_resources(ctx),
        reads=tuple(str(path) for path in reads),
        writes=tuple(str(path) for path in writes),
    )


class SquadSftDataset:
    """`sft_squad`: SQuAD v1.1 train and dev files; the dev lines keep every answer."""

    FIX = "Download SQuAD v1.1 (rajpurkar.github.io/SQuAD-explorer) or set {key}=/path/to/it"

    @staticmethod
    def _files(ctx: StageContext) -> list[tuple[Path, Path, bool]]:
        """(input, output, keep every answer) for the train file and the dev file."""
        cfg = ctx.cfg
        return [
            (Path(str(cfg.train_file)), Path(str(cfg.train_output)), False),
            (Path(str(cfg.dev_file)), Path(str(cfg.dev_output)), True),
        ]

    def validate(self, ctx: StageContext) -> None:
        inputs = {name: require_source(ctx, name, self.FIX) for name in ("train_file", "dev_file")}
        train = require_output(ctx, "train_output", inputs)
        dev = require_output(ctx, "dev_output", inputs)
        if train == dev:
            raise ConfigError(
                stage_key(ctx, "dev_output"), "is train_output too", "Give each its own file"
            )
        require_fraction(stage_key(ctx, "max_bad_fraction"), ctx.cfg.max_bad_fraction)

    def jobs(self, ctx: StageContext) -> list[JobSpec]:
        limit = ("--max-bad-fraction", str(ctx.cfg.max_bad_fraction))
        files = self._files(ctx)
        commands = tuple(
            Command(
                PROGRAM,
                ("squad", "--input", str(source), "--output", str(output), *limit)
                + (("--all-answers",) if all_answers else ()),
            )
            for source, output, all_answers in files
        )
        return [
            sft_job(ctx, commands, [source for source, _, _ in files], [o for _, o, _ in files])
        ]


class DollySftDataset:
    """`sft_dolly`: Dolly-style JSON lines, optionally split into train/validation/test."""

    FIX = "Download databricks-dolly-15k.jsonl or set {key}=/path/to/your.jsonl"

    def _splits(self, ctx: StageContext) -> dict[str, float]:
        """The fractions of split_fractions above zero, in the order train, validation, test;
        empty when split_fractions is null (one output file)."""
        key, value = stage_key(ctx, "split_fractions"), ctx.cfg.get("split_fractions")
        if value is None:
            return {}
        if not isinstance(value, Mapping | DictConfig) or not value:
            raise ConfigError(
                key,
                f"{value!r} is not a table of split fractions",
                "Give e.g. {train: 0.9, validation: 0.05, test: 0.05}, or null for one file",
            )
        for name in value:
            if name not in SPLIT_NAMES:
                raise ConfigError(
                    f"{key}.{name}", "is not a split", f"Use: {', '.join(SPLIT_NAMES)}"
                )
        fractions = {
            name: require_fraction(f"{key}.{name}", value[name])
            for name in SPLIT_NAMES
            if name in value
        }
        total = sum(fractions.values())
        if not math.isclose(total, 1.0, abs_tol=1e-6):
            raise ConfigError(key, f"the fractions sum to {total:g}", "Make them sum to 1")
        return {name: fraction for name, fraction in fractions.items() if fraction > 0}

    def _outputs(self, ctx: StageContext, source: Path) -> dict[str, Path]:
        cfg = ctx.cfg
        name = cfg.get("output_name")
        if not isinstance(name, str) or not name or "/" in name:
            raise ConfigError(
                stage_key(ctx, "output_name"),
                f"{name!r} is not a file-name prefix",
                "Give one without '/', such as dolly",
            )
        if cfg.get("output_dir") in (None, ""):
            key = stage_key(ctx, "output_dir")
            raise ConfigError(key, "is not set", f"Set {key}=/path/to/folder")
        folder = Path(str(cfg.output_dir))
        splits = self._splits(ctx)
        outputs = {split: folder / f"{name}_{split}.jsonl" for split in splits}
        outputs = outputs or {"all": folder / f"{name}.jsonl"}
        if source in outputs.values():
            raise ConfigError(
                stage_key(ctx, "output_name"),
                f"would write over the input {source}",
                "Choose another output_name or output_dir",
            )
        return outputs

    def validate(self, ctx: StageContext) -> None:
        source = require_source(ctx, "input_file", self.FIX)
        self._outputs(ctx, source)
        require_int(stage_key(ctx, "seed"), ctx.cfg.seed, minimum=0)
        require_fraction(stage_key(ctx, "max_bad_fraction"), ctx.cfg.max_bad_fraction)

    def jobs(self, ctx: StageContext) -> list[JobSpec]:
        cfg = ctx.cfg
        source = Path(str(cfg.input_file))
        outputs = self._outputs(ctx, source)
        splits = self._splits(ctx)
        args: tuple[str, ...] = ("dolly", "--input", str(source))
        if splits:
            for split, fraction in splits.items():
                args += ("--split", split, repr(float(fraction)), str(outputs[split]))
            args += ("--seed", str(cfg.seed))
        else:
            args += ("--output", str(outputs["all"]))
        args += ("--max-bad-fraction", str(cfg.max_bad_fraction))
        return [sft_job(ctx, (Command(PROGRAM, args),), [source], outputs.values())]
