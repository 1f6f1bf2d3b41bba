"""SFT datasets of the data_preparation stage: local SQuAD or Dolly-style files converted into
the JSON lines ("input", "output") that the fine-tuning and PEFT recipes read.

One CPU job each, running launcher_scripts.jobs.data_prep.sft_convert (squad: once for the
train file and once for the dev file). The inputs must exist before the run (or be written by
an earlier stage of it); a dry run lists the missing ones instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from launcher_scripts.config.checks import require_fraction, require_int
from launcher_scripts.errors import ConfigError
from launcher_scripts.formats.shards import SPLIT_NAMES
from launcher_scripts.jobspec import Command, JobSpec
from launcher_scripts.stages.base import StageContext, make_job
from launcher_scripts.stages.data_prep_common import JOBS, cpu_resources, program_job, stage_key

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


def optional_output(ctx: StageContext, name: str, inputs: Mapping[str, Path]) -> Path | None:
    """`<stage>.<name>`: an output file, or null for none."""
    if ctx.cfg.get(name) in (None, ""):
        return None
    return require_output(ctx, name, inputs)


def distinct(ctx: StageContext, outputs: Mapping[str, Path | None]) -> None:
    """No two outputs of a job are one file."""
    seen: dict[Path, str] = {}
    for name, path in outputs.items():
        if path is None:
            continue
        if path in seen:
            raise ConfigError(
                stage_key(ctx, name), f"is {seen[path]} too", "Give each its own file"
            )
        seen[path] = name


@dataclass(frozen=True)
class SquadConversion:
    """One SQuAD-format file and what it becomes: JSON lines and/or a text-to-text pair."""

    source: Path
    jsonl: Path | None
    text_to_text: tuple[Path, Path] | None
    all_answers: bool

    def args(self, limit: tuple[str, ...]) -> tuple[str, ...]:
        args: tuple[str, ...] = ("squad", "--input", str(self.source))
        if self.jsonl is not None:
            args += ("--output", str(self.jsonl))
        if self.text_to_text is not None:
            args += ("--text-to-text", *(str(p) for p in self.text_to_text))
        return args + limit + (("--all-answers",) if self.all_answers else ())

    @property
    def writes(self) -> list[Path]:
        return [p for p in (self.jsonl, *(self.text_to_text or ())) if p is not None]


def squad_jobs(ctx: StageContext, conversions: list[SquadConversion]) -> list[JobSpec]:
    limit = ("--max-bad-fraction", str(ctx.cfg.max_bad_fraction))
    commands = tuple(Command(PROGRAM, c.args(limit)) for c in conversions)
    reads = [c.source for c in conversions]
    return [sft_job(ctx, commands, reads, [p for c in conversions for p in c.writes])]


class SquadSftDataset:
    """`sft_squad`: SQuAD v1.1 train and dev files, as JSON lines (GPT's recipes; the dev lines
    keep every answer) and as text-to-text pairs (T5's and mT5's recipes)."""

    FIX = "Download SQuAD v1.1 (rajpurkar.github.io/SQuAD-explorer) or set {key}=/path/to/it"
    OUTPUTS = ("output", "src_output", "tgt_output")

    def _conversions(self, ctx: StageContext) -> list[SquadConversion]:
        inputs = {name: Path(str(ctx.cfg[name])) for name in ("train_file", "dev_file")}
        outputs = {
            f"{split}_{kind}": optional_output(ctx, f"{split}_{kind}", inputs)
            for split in ("train", "dev")
            for kind in self.OUTPUTS
        }
        distinct(ctx, outputs)
        conversions = []
        for split in ("train", "dev"):
            jsonl, src, tgt = (outputs[f"{split}_{kind}"] for kind in self.OUTPUTS)
            if (src is None) != (tgt is None):
                missing = f"{split}_tgt_output" if tgt is None else f"{split}_src_output"
                raise ConfigError(
                    stage_key(ctx, missing),
                    "is not set while its text-to-text partner is",
                    "Set both (inputs and answers), or neither",
                )
            pair = (src, tgt) if src is not None and tgt is not None else None
            if jsonl is None and pair is None:
                raise ConfigError(
                    stage_key(ctx, f"{split}_output"),
                    f"is null and so are {split}_src_output and {split}_tgt_output",
                    "Set at least one output",
                )
            conversions.append(
                SquadConversion(inputs[f"{split}_file"], jsonl, pair, split == "dev")
            )
        return conversions

    def validate(self, ctx: StageContext) -> None:
        for name in ("train_file", "dev_file"):
            require_source(ctx, name, self.FIX)
        self._conversions(ctx)
        require_fraction(stage_key(ctx, "max_bad_fraction"), ctx.cfg.max_bad_fraction)

    def tokenized_with(self, ctx: StageContext) -> dict[str, dict[str, str]]:
        return {}  # JSONL records, tokenized by the tuning job

    def jobs(self, ctx: StageContext) -> list[JobSpec]:
        return squad_jobs(ctx, self._conversions(ctx))


class PromptSquadDataset:
    """`prompt_squad`: SQuAD v1.1 downloaded (or a local copy) and written as NeMo's
    prompt-learning records, which the prompt-learning, adapter and IA3 recipes read: the train
    file into squad_train.jsonl and a seeded share of it into squad_val.jsonl, the dev file
    (every answer kept, for exact match) into squad_test.jsonl."""

    FIX = "Set download=true to fetch it, or {key}=/path/to/a/local/copy"
    SPLITS = ("squad_train.jsonl", "squad_val.jsonl", "squad_test.jsonl")

    def _outputs(self, ctx: StageContext) -> list[Path]:
        if ctx.cfg.get("output_dir") in (None, ""):
            raise ConfigError(stage_key(ctx, "output_dir"), "is not set", "Set it to a folder")
        folder = Path(str(ctx.cfg.output_dir))
        return [folder / name for name in self.SPLITS]

    def validate(self, ctx: StageContext) -> None:
        cfg = ctx.cfg
        inputs = {name: Path(str(cfg[name])) for name in ("train_file", "dev_file")}
        if cfg.download:
            for name in ("train_url", "dev_url"):
                if cfg.get(name) in (None, ""):
                    raise ConfigError(stage_key(ctx, name), "is not set", "Give the file's URL")
        else:
            for name in inputs:
                require_source(ctx, name, self.FIX)
        for output in self._outputs(ctx):
            if output in inputs.values():
                raise ConfigError(
                    stage_key(ctx, "output_dir"), f"{output} is an input too", "Write elsewhere"
                )
        share = require_fraction(stage_key(ctx, "validation_fraction"), cfg.validation_fraction)
        if not 0 < share < 1:
            raise ConfigError(
                stage_key(ctx, "validation_fraction"),
                f"{share} leaves no training or no validation questions",
                "Use a share between 0 and 1, e.g. 0.1",
            )
        require_int(stage_key(ctx, "seed"), cfg.seed, minimum=0)
        require_fraction(stage_key(ctx, "max_bad_fraction"), cfg.max_bad_fraction)

    def tokenized_with(self, ctx: StageContext) -> dict[str, dict[str, str]]:
        return {}  # JSONL records, tokenized by the tuning job

    def jobs(self, ctx: StageContext) -> list[JobSpec]:
        cfg, name = ctx.cfg, str(ctx.cfg.run.name)
        train, dev = Path(str(cfg.train_file)), Path(str(cfg.dev_file))
        jobs = []
        if cfg.download:
            files = ("--file", str(cfg.train_url), str(train), "--file", str(cfg.dev_url), str(dev))
            jobs.append(
                program_job(
                    ctx, f"{name}-download", "download", files, None, (str(train), str(dev))
                )
            )
        train_out, val_out, test_out = self._outputs(ctx)
        limit = ("--max-bad-fraction", str(cfg.max_bad_fraction))
        split = (
            "--validation",
            str(val_out),
            "--validation-fraction",
            str(cfg.validation_fraction),
        )
        commands = (
            Command(
                PROGRAM,
                ("squad-prompt", "--input", str(train), "--output", str(train_out), *split)
                + ("--seed", str(cfg.seed), *limit),
            ),
            Command(
                PROGRAM,
                ("squad-prompt", "--input", str(dev), "--output", str(test_out), "--all-answers")
                + limit,
            ),
        )
        jobs.append(sft_job(ctx, commands, (train, dev), (train_out, val_out, test_out)))
        return jobs


class XquadSftDataset:
    """`sft_xquad`: XQuAD's per-language files (SQuAD's dev set translated, in SQuAD's format)
    as text-to-text pairs beside them, which mt5/xquad validates on."""

    FIX = "Download XQuAD (github.com/google-deepmind/xquad) or set {key}=/path/to/its/folder"

    def _conversions(self, ctx: StageContext) -> list[SquadConversion]:
        key = stage_key(ctx, "languages")
        languages = ctx.cfg.get("languages")
        if not languages or not all(
            isinstance(name, str) and name.isidentifier() for name in languages
        ):
            raise ConfigError(
                key, f"{languages!r} is not a list of language codes", "Give e.g. [en, es, de]"
            )
        if ctx.cfg.get("xquad_dir") in (None, ""):
            raise ConfigError(stage_key(ctx, "xquad_dir"), "is not set", "Set it to the folder")
        folder = Path(str(ctx.cfg.xquad_dir))
        conversions = []
        for language in languages:
            source = folder / f"xquad.{language}.json"
            pair = (folder / f"xquad.{language}_src.txt", folder / f"xquad.{language}_tgt.txt")
            conversions.append(SquadConversion(source, None, pair, False))
        return conversions

    def validate(self, ctx: StageContext) -> None:
        key = stage_key(ctx, "languages")
        for conversion, language in zip(self._conversions(ctx), ctx.cfg.languages, strict=True):
            source = conversion.source
            if not source.is_file() and not ctx.will_exist(source):
                raise ConfigError(
                    key, f"{source} (language {language}) does not exist", self.FIX.format(key=key)
                )
        require_fraction(stage_key(ctx, "max_bad_fraction"), ctx.cfg.max_bad_fraction)

    def tokenized_with(self, ctx: StageContext) -> dict[str, dict[str, str]]:
        return {}  # JSONL records, tokenized by the tuning job

    def jobs(self, ctx: StageContext) -> list[JobSpec]:
        return squad_jobs(ctx, self._conversions(ctx))


class DollySftDataset:
    """`sft_dolly`: Dolly-style JSON lines, optionally split into train/validation/test."""

    FIX = "Set download_url to fetch it (databricks-dolly-15k.jsonl) or {key}=/path/to/your.jsonl"

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
        if ctx.cfg.get("download_url"):  # input_file is where the download goes
            source = Path(str(ctx.cfg.input_file))
        else:
            source = require_source(ctx, "input_file", self.FIX)
        self._outputs(ctx, source)
        require_int(stage_key(ctx, "seed"), ctx.cfg.seed, minimum=0)
        require_fraction(stage_key(ctx, "max_bad_fraction"), ctx.cfg.max_bad_fraction)

    def tokenized_with(self, ctx: StageContext) -> dict[str, dict[str, str]]:
        return {}  # JSONL records, tokenized by the tuning job

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
        jobs = []
        if cfg.get("download_url"):
            files = ("--file", str(cfg.download_url), str(source))
            name = f"{cfg.run.name}-download"
            jobs.append(program_job(ctx, name, "download", files, None, (str(source),)))
        return [*jobs, sft_job(ctx, (Command(PROGRAM, args),), [source], outputs.values())]
