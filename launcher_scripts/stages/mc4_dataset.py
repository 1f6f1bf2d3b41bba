"""mC4 for mT5: download the chosen languages' files over HTTP(S), tokenize them with the mT5
SentencePiece model, and merge them into one indexed dataset per language.

Jobs: download_tokenizer, then download, preprocess and merge, each a node array. download and
preprocess share the files by rank (task i tokenizes what task i downloaded: Slurm's
aftercorr); merge waits for every preprocess task and shares the languages. The work is split
by file, so NeMo's worker-mapping files, language splits (max_split_size) and soft links are
not needed: each task derives its share from the file list alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from omegaconf import DictConfig, ListConfig

from launcher_scripts.config.checks import require_fraction, require_int
from launcher_scripts.errors import ConfigError
from launcher_scripts.formats import indexed_writer
from launcher_scripts.formats.mc4_files import (
    PARTS_DIR,
    Mc4File,
    dataset_prefix,
    part_prefix,
    plan_files,
)
from launcher_scripts.jobspec import JobSpec
from launcher_scripts.stages.base import StageContext
from launcher_scripts.stages.data_prep_common import (
    array_size,
    program_job,
    require_url,
    stage_key,
    workers_args,
)


class Mc4Dataset:
    """The `mc4` dataset of data_preparation recipes (mt5/download_mc4)."""

    def validate(self, ctx: StageContext) -> None:
        cfg = ctx.cfg
        languages = self.languages(ctx)
        array_size(ctx, sum(count for _, count in languages))
        workers_args(ctx)
        require_fraction(stage_key(ctx, "max_bad_fraction"), cfg.max_bad_fraction)
        if cfg.download_mc4:
            self._require_source(ctx)
        elif cfg.preprocess_data:
            self._require_downloaded(ctx, languages)
        if cfg.preprocess_data:
            require_url(ctx, "download_tokenizer_url", allow_path=True)
            if cfg.download_vocab_url:
                require_url(ctx, "download_vocab_url", allow_path=True)

    def languages(self, ctx: StageContext) -> list[tuple[str, int]]:
        """The chosen languages and their file counts, in the order given."""
        cfg = ctx.cfg
        counts = self._file_counts(ctx)
        chosen = self._chosen(ctx, counts)
        english = bool(cfg.use_cleaned_english) and "en" in chosen
        if english:
            require_int(
                stage_key(ctx, "cleaned_english_file_count"), cfg.cleaned_english_file_count
            )
        return [
            (name, cfg.cleaned_english_file_count if english and name == "en" else counts[name])
            for name in chosen
        ]

    @staticmethod
    def _file_counts(ctx: StageContext) -> dict[str, int]:
        table = ctx.cfg.language_file_counts
        if not isinstance(table, Mapping | DictConfig) or not table:
            raise ConfigError(
                stage_key(ctx, "language_file_counts"),
                "is not a table of languages and their file counts",
                "Give one such as {cs: 1024, de: 2048}",
            )
        counts = {}
        for name, count in table.items():
            counts[str(name)] = require_int(stage_key(ctx, f"language_file_counts.{name}"), count)
        return counts

    @staticmethod
    def _chosen(ctx: StageContext, counts: dict[str, int]) -> list[str]:
        name = stage_key(ctx, "languages")
        value: Any = ctx.cfg.languages
        if value == "all":
            return list(counts)
        if isinstance(value, str):
            items: list[Any] = [item.strip() for item in value.split(",")]
        elif isinstance(value, list | ListConfig):
            items = list(value)
        else:
            raise ConfigError(name, f"{value!r} is not a list of languages", "Give e.g. 'cs,de'")
        if not items or any(item in ("", None) for item in items):
            raise ConfigError(name, f"{value!r} has an empty entry", "Give e.g. 'cs,de,en'")
        table = stage_key(ctx, "language_file_counts")
        for item in items:
            if isinstance(item, bool):  # YAML reads an unquoted no/yes as a boolean
                raise ConfigError(name, f"has the boolean {item}", "Quote language codes: 'no'")
            if str(item) not in counts:
                raise ConfigError(
                    name,
                    f"{item!r} is not a language of {table}",
                    f"Use languages from that table or 'all', or add it: +{table}.{item}=COUNT",
                )
        names = [str(item) for item in items]
        repeated = sorted({item for item in names if names.count(item) > 1})
        if repeated:
            raise ConfigError(name, f"names {', '.join(repeated)} twice", "List each once")
        return names

    @staticmethod
    def _require_source(ctx: StageContext) -> None:
        value = str(ctx.cfg.c4_url or "")
        scheme = urlparse(value).scheme
        if scheme in ("http", "https"):
            return
        if scheme in ("", "file") and Path(value.removeprefix("file://")).is_dir():
            return
        raise ConfigError(
            stage_key(ctx, "c4_url"),
            f"{value!r} is neither an http(s) URL nor a folder",
            "Give the URL (or a local copy) of the allenai/c4 dataset",
        )

    def _require_downloaded(self, ctx: StageContext, languages: list[tuple[str, int]]) -> None:
        """Without download_mc4 the files must be in c4_dir (unless already tokenized)."""
        c4_dir, output = self._dirs(ctx)
        files = plan_files(languages, bool(ctx.cfg.use_cleaned_english))
        done: dict[str, bool] = {}
        missing: list[Mc4File] = []
        for file in files:
            if file.language not in done:
                prefix = dataset_prefix(output, file.language)
                done[file.language] = indexed_writer.is_complete(prefix)
            if done[file.language] or (c4_dir / file.name).is_file():
                continue
            if not indexed_writer.is_complete(part_prefix(output, file)):
                missing.append(file)
        if missing:
            raise ConfigError(
                stage_key(ctx, "c4_dir"),
                f"{len(missing)} of the {len(files)} files are missing, e.g. "
                f"{c4_dir / missing[0].name}",
                f"Download them (set {stage_key(ctx, 'download_mc4')}=true) or fix the folder",
            )

    @staticmethod
    def _dirs(ctx: StageContext) -> tuple[Path, Path]:
        return Path(str(ctx.cfg.c4_dir)), Path(str(ctx.cfg.preprocessed_dir))

    def tokenized_with(self, ctx: StageContext) -> dict[str, dict[str, str]]:
        """Each language's dataset, made with the recipe's SentencePiece model."""
        if not ctx.cfg.preprocess_data:
            return {}
        _, output = self._dirs(ctx)
        files = {"model": str(ctx.cfg.tokenizer_model)}
        return {str(dataset_prefix(output, lang)): files for lang, _ in self.languages(ctx)}

    def jobs(self, ctx: StageContext) -> list[JobSpec]:
        cfg, name = ctx.cfg, str(ctx.cfg.run.name)
        languages = self.languages(ctx)
        c4_dir, output = self._dirs(ctx)
        spec = ",".join(f"{language}:{count}" for language, count in languages)
        common = ("--languages", spec)
        common += ("--cleaned-english",) if cfg.use_cleaned_english else ()
        files_at = ("--c4-dir", str(c4_dir))
        files = array_size(ctx, sum(count for _, count in languages))
        jobs = []
        if cfg.preprocess_data:
            jobs.append(self._tokenizer_job(ctx, name))
        if cfg.download_mc4:
            args = ("download", *common, *files_at, "--url-base", str(cfg.c4_url))
            args += ("--output-dir", str(output))
            if cfg.preprocess_data:
                # Files tokenized with another tokenizer than this one are fetched again.
                args += ("--tokenizer-model", str(cfg.tokenizer_model))
            jobs.append(program_job(ctx, f"{name}-download", "mc4", args, files, (str(c4_dir),)))
        if cfg.preprocess_data:
            args = ("preprocess", *common, *files_at, "--output-dir", str(output))
            args += ("--tokenizer-model", str(cfg.tokenizer_model))
            args += ("--max-bad-fraction", str(cfg.max_bad_fraction))
            args += workers_args(ctx)
            args += ("--remove-downloaded",) if cfg.rm_downloaded else ()
            parts = (str(output / PARTS_DIR),)
            chained = bool(cfg.download_mc4)
            jobs.append(program_job(ctx, f"{name}-preprocess", "mc4", args, files, parts, chained))
            args = ("merge", *common, "--output-dir", str(output))
            datasets = tuple(str(dataset_prefix(output, language)) for language, _ in languages)
            merges = array_size(ctx, len(languages))
            jobs.append(program_job(ctx, f"{name}-merge", "mc4", args, merges, datasets))
        return jobs

    @staticmethod
    def _tokenizer_job(ctx: StageContext, name: str) -> JobSpec:
        cfg = ctx.cfg
        files = ("--file", str(cfg.download_tokenizer_url), str(cfg.tokenizer_model))
        saved = (str(cfg.tokenizer_model),)
        if cfg.download_vocab_url:
            vocab = str(Path(str(cfg.vocab_save_dir)) / "vocab.txt")
            files += ("--file", str(cfg.download_vocab_url), vocab)
            saved += (vocab,)
        return program_job(ctx, f"{name}-download_tokenizer", "download", files, None, saved)
