"""The data_preparation stage: the recipe's `dataset` key picks how its jobs are built."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from omegaconf import DictConfig

from launcher_scripts.config.checks import (
    require_choice,
    require_file,
    require_fraction,
    require_input,
    require_int,
)
from launcher_scripts.config.schema import Declared
from launcher_scripts.errors import ConfigError
from launcher_scripts.families import DEFAULT as DEFAULT_FAMILY
from launcher_scripts.families import FAMILIES, family_of
from launcher_scripts.families.encoder_checks import WORDPIECE_TYPES
from launcher_scripts.formats.shards import parse_file_numbers
from launcher_scripts.formats.tokenizer import trained_tokenizer_file
from launcher_scripts.jobspec import Command, JobSpec
from launcher_scripts.stages.base import StageContext, StageDefaults, make_job, register
from launcher_scripts.stages.data_prep_common import (
    JOBS,
    array_size,
    cpu_resources,
    program_job,
    require_url,
    stage_key,
    workers_args,
)
from launcher_scripts.stages.mc4_dataset import Mc4Dataset
from launcher_scripts.stages.sft_dataset import (
    DollySftDataset,
    PromptSquadDataset,
    SquadSftDataset,
    XquadSftDataset,
)

INPUT_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
# SentencePiece's model types, and a BERT WordPiece vocabulary (BERT and T5 data).
TOKENIZER_MODEL_TYPES = ("unigram", "bpe", "word", "char", "wordpiece")


# A dataset prefix the stage writes -> the tokenizer files it tokenizes it with, by the role
# preprocess records them under (model, vocab_file, merge_file).
TokenizedWith = dict[str, dict[str, str]]
# The preprocess program's option for each role.
PREPROCESS_FLAGS = {
    "model": "--tokenizer-model",
    "vocab_file": "--vocab-file",
    "merge_file": "--merge-file",
}


class Dataset(Protocol):
    def validate(self, ctx: StageContext) -> None: ...

    def jobs(self, ctx: StageContext) -> list[JobSpec]: ...

    def tokenized_with(self, ctx: StageContext) -> TokenizedWith:
        """The indexed datasets its jobs write and the tokenizer of each (the training stage
        compares it with its recipe's)."""
        ...


def output_stem(source: Path) -> str:
    """The shard name the preprocess job derives from an input: its name without suffixes."""
    name = source.name
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


@dataclass(frozen=True)
class TextSettings:
    """How custom_dataset tokenizes: its recipe's values, where null the training recipe's."""

    split_sentences: bool
    append_eod: bool
    lower_case: bool
    model_type: str  # of the tokenizer it trains


def text_settings(cfg: DictConfig) -> TextSettings:
    """The recipe's values, its nulls following `for_training` (the run's training recipe, or
    GPT's when there is none): its family's kind of data, its tokenizer's kind and casing."""
    follow = cfg.get("for_training") or {}
    family = FAMILIES.get(str(follow.get("model_family") or DEFAULT_FAMILY))
    tokenizer = follow.get("tokenizer_type")
    wordpiece = follow.get("tokenizer_library") == "megatron" and tokenizer in WORDPIECE_TYPES
    split, append_eod = cfg.get("split_sentences"), cfg.get("append_eod")
    lower_case, model_type = cfg.get("lower_case"), cfg.train_tokenizer_args.get("model_type")
    if split is None:
        split = family is not None and family.sentence_data
    if append_eod is None:
        append_eod = not split  # sentence-split data marks a document by its sentences
    if lower_case is None:
        lower_case = tokenizer == "BertWordPieceLowerCase"
    if model_type is None:
        model_type = "wordpiece" if wordpiece else "bpe"
    return TextSettings(bool(split), bool(append_eod), bool(lower_case), str(model_type))


class CustomDataset:
    """Your own files; optionally a SentencePiece tokenizer trained on them first."""

    def validate(self, ctx: StageContext) -> None:
        cfg = ctx.cfg
        files = self._inputs(ctx)
        seen: dict[str, Path] = {}
        for index, source in enumerate(files):
            key = stage_key(ctx, f"raw_dataset_files[{index}]")
            if ctx.written_upstream(source):  # e.g. data_curation's output folder
                pass
            elif not source.exists() and not source.name.endswith(INPUT_SUFFIXES):
                raise ConfigError(
                    key,
                    ctx.not_written(source),
                    "Give existing files or folders, or run the stage that writes it in the "
                    "same run (data_curation's output: stages=[data_curation,data_preparation])",
                )
            elif not ctx.left_for_the_run(source):
                require_input(key, source, INPUT_SUFFIXES)
            stem = output_stem(source)
            if stem in seen:
                raise ConfigError(
                    key,
                    f"{source} and {seen[stem]} would both write the shard {stem}",
                    "Rename one of them",
                )
            seen[stem] = source
        require_fraction(stage_key(ctx, "max_bad_fraction"), cfg.max_bad_fraction)
        for name in ("split_sentences", "lower_case", "append_eod"):
            if not isinstance(cfg.get(name), bool | None):
                raise ConfigError(stage_key(ctx, name), "is not true, false or null", "Fix it")
        workers_args(ctx)
        if cfg.train_tokenizer:
            self._validate_training(ctx)
        elif cfg.preprocess_data:
            self._validate_tokenizer(ctx)

    def _validate_training(self, ctx: StageContext) -> None:
        args = ctx.cfg.train_tokenizer_args
        prefix = stage_key(ctx, "train_tokenizer_args")
        model_type = text_settings(ctx.cfg).model_type
        require_choice(f"{prefix}.model_type", model_type, TOKENIZER_MODEL_TYPES)
        require_choice(f"{prefix}.input_format", args.input_format, ("text", "tsv"))
        require_int(f"{prefix}.vocab_size", args.vocab_size, minimum=8)
        for index, source in enumerate(self._tokenizer_inputs(ctx)):
            if not ctx.left_for_the_run(source):
                require_input(f"{prefix}.input[{index}]", source, (*INPUT_SUFFIXES, ".txt", ".tsv"))
        trained = self._trained_model(ctx)
        name = "vocab_file" if self._wordpiece(ctx) else "tokenizer_model"
        given = ctx.cfg.get(name)
        if ctx.cfg.preprocess_data and given is not None and Path(str(given)) != trained:
            raise ConfigError(
                stage_key(ctx, name),
                f"is {given} but the tokenizer being trained is {trained}",
                f"Leave {name} at its default (null for vocab_file), or set train_tokenizer=false",
            )

    def _validate_tokenizer(self, ctx: StageContext) -> None:
        cfg = ctx.cfg
        if cfg.merge_file:
            names = ("vocab_file", "merge_file")
        elif cfg.vocab_file:  # a BERT WordPiece vocab.txt
            names = ("vocab_file",)
        else:
            names = ("tokenizer_model",)
        for name in names:
            if cfg[name] in (None, "") or not ctx.left_for_the_run(cfg[name]):
                require_file(stage_key(ctx, name), cfg[name])

    @staticmethod
    def _inputs(ctx: StageContext) -> list[Path]:
        files = ctx.cfg.raw_dataset_files
        if not files:
            raise ConfigError(
                stage_key(ctx, "raw_dataset_files"),
                "is empty",
                f"Set {stage_key(ctx, 'raw_dataset_files')}=[/data/a.jsonl,/data/b.jsonl.gz]",
            )
        return [Path(str(f)) if f is not None else None for f in files]  # type: ignore[misc]

    def _tokenizer_inputs(self, ctx: StageContext) -> Sequence[Path]:
        given = ctx.cfg.train_tokenizer_args.input
        if given is None:
            return self._inputs(ctx)
        return [Path(str(p)) for p in ([given] if isinstance(given, str) else given)]

    @staticmethod
    def _wordpiece(ctx: StageContext) -> bool:
        """Whether the data is tokenized with a BERT WordPiece vocabulary (trained or given)."""
        cfg = ctx.cfg
        if cfg.train_tokenizer:
            return text_settings(cfg).model_type == "wordpiece"
        return bool(cfg.vocab_file) and not cfg.merge_file

    @staticmethod
    def _trained_model(ctx: StageContext) -> Path:
        cfg, args = ctx.cfg, ctx.cfg.train_tokenizer_args
        prefix = Path(str(cfg.bpe_save_dir)) / str(args.model_prefix)
        return trained_tokenizer_file(str(prefix), text_settings(cfg).model_type)

    def jobs(self, ctx: StageContext) -> list[JobSpec]:
        cfg, name = ctx.cfg, str(ctx.cfg.run.name)
        settings = text_settings(cfg)
        files = [str(p) for p in self._inputs(ctx)]
        jobs = []
        if cfg.train_tokenizer:
            jobs.append(self._train_tokenizer_job(ctx, name))
        if cfg.preprocess_data:
            args = ["--input", *files, "--output-dir", str(cfg.preprocessed_dir)]
            args += ["--text-key", str(cfg.text_key)]
            args += self._tokenizer_args(ctx)
            args += workers_args(ctx)
            args += ["--max-bad-fraction", str(cfg.max_bad_fraction)]
            if not settings.append_eod:
                args.append("--no-append-eod")
            if settings.split_sentences:
                args.append("--split-sentences")
            outputs = self._outputs(ctx)
            jobs.append(
                make_job(
                    ctx,
                    f"{name}-preprocess",
                    (Command(f"{JOBS}.preprocess", tuple(args)),),
                    cpu_resources(ctx),
                    array_size=array_size(ctx, len(files)),
                    reads=tuple(files),
                    writes=outputs,
                )
            )
        return jobs

    def _outputs(self, ctx: StageContext) -> tuple[str, ...]:
        cfg = ctx.cfg
        # Megatron's names: sentence-split data ends in _sentence, other data in _document.
        level = "sentence" if text_settings(cfg).split_sentences else "document"
        folder = Path(str(cfg.preprocessed_dir))
        return tuple(
            str(folder / f"{output_stem(source)}_{cfg.text_key}_{level}")
            for source in self._inputs(ctx)
        )

    def tokenized_with(self, ctx: StageContext) -> TokenizedWith:
        if not ctx.cfg.preprocess_data:
            return {}
        files = self._tokenizer_files(ctx)
        return {output: files for output in self._outputs(ctx)}

    def _tokenizer_files(self, ctx: StageContext) -> dict[str, str]:
        """The tokenizer's files by the role preprocess takes them in (PREPROCESS_FLAGS)."""
        cfg = ctx.cfg
        if self._wordpiece(ctx):
            vocab = self._trained_model(ctx) if cfg.train_tokenizer else cfg.vocab_file
            return {"vocab_file": str(vocab)}
        if cfg.train_tokenizer:
            return {"model": str(self._trained_model(ctx))}
        if cfg.merge_file:
            return {"vocab_file": str(cfg.vocab_file), "merge_file": str(cfg.merge_file)}
        return {"model": str(cfg.tokenizer_model)}

    def _tokenizer_args(self, ctx: StageContext) -> list[str]:
        files = self._tokenizer_files(ctx)
        args = [arg for role, path in files.items() for arg in (PREPROCESS_FLAGS[role], path)]
        if self._wordpiece(ctx) and text_settings(ctx.cfg).lower_case:
            args.append("--lower-case")
        return args

    def _train_tokenizer_job(self, ctx: StageContext, name: str) -> JobSpec:
        cfg, args = ctx.cfg, ctx.cfg.train_tokenizer_args
        model = self._trained_model(ctx)
        inputs = [str(p) for p in self._tokenizer_inputs(ctx)]
        argv = ["--input", *inputs, "--text-key", str(cfg.text_key)]
        argv += ["--model-prefix", str(Path(str(cfg.bpe_save_dir)) / str(args.model_prefix))]
        settings = text_settings(cfg)
        argv += ["--input-format", str(args.input_format), "--model-type", settings.model_type]
        for option in ("vocab_size", "character_coverage", "unk_id", "bos_id", "eos_id", "pad_id"):
            argv += [f"--{option.replace('_', '-')}", str(args[option])]
        if settings.lower_case:
            argv.append("--lower-case")
        return make_job(
            ctx,
            f"{name}-train_tokenizer",
            (Command(f"{JOBS}.train_tokenizer", tuple(argv)),),
            cpu_resources(ctx),
            reads=tuple(inputs),
            writes=(str(model),),
        )


@dataclass(frozen=True)
class TokenizerFiles:
    """What a Megatron tokenizer_type needs: the files it is saved as, the preprocess flags."""

    vocab_name: str  # in vocab_save_dir
    merges_name: str | None = None  # in merges_save_dir; None: the type has no merges file
    flags: tuple[str, ...] = ()


# Every tokenizer_type a Pile recipe may name.
TOKENIZER_TYPES: dict[str, TokenizerFiles] = {
    "GPT2BPETokenizer": TokenizerFiles("vocab.json", "merges.txt"),
    "BertWordPieceCase": TokenizerFiles("vocab.txt"),
    "BertWordPieceLowerCase": TokenizerFiles("vocab.txt", flags=("--lower-case",)),
}


class PileDataset:
    """Shards of the Pile: download, extract and tokenize, each step a node array.

    The recipe says everything model-specific: the tokenizer (tokenizer_type, looked up in
    TOKENIZER_TYPES), the output names (output_prefix) and whether documents are split into
    sentences (split_sentences, BERT's datasets).
    """

    shard_name = "{:02d}.jsonl.zst"

    def validate(self, ctx: StageContext) -> None:
        cfg = ctx.cfg
        numbers = self._numbers(ctx)
        self._check_array(ctx, numbers)
        array_size(ctx, len(numbers))
        workers_args(ctx)
        # The tokenizer types the family's models are trained with.
        tokenizers = family_of(cfg, ctx.stage).pile_tokenizers
        require_choice(stage_key(ctx, "tokenizer_type"), cfg.tokenizer_type, tokenizers)
        self._output_prefix(ctx)
        if not isinstance(ctx.cfg.split_sentences, bool):
            raise ConfigError(stage_key(ctx, "split_sentences"), "is not true or false", "Fix it")
        if cfg.download_the_pile:
            require_url(ctx, "the_pile_url", allow_path=False)
        elif cfg.preprocess_data:
            for number in numbers:
                require_file(stage_key(ctx, "file_numbers"), self._extracted(ctx, number))
        if cfg.preprocess_data:
            self._validate_tokenizer_files(ctx)

    def _validate_tokenizer_files(self, ctx: StageContext) -> None:
        tokenizer = TOKENIZER_TYPES[ctx.cfg.tokenizer_type]
        require_url(ctx, "download_vocab_url", allow_path=True)
        if tokenizer.merges_name:
            require_url(ctx, "download_merges_url", allow_path=True)
        elif ctx.cfg.get("download_merges_url"):
            raise ConfigError(
                stage_key(ctx, "download_merges_url"),
                f"is set but {ctx.cfg.tokenizer_type} uses no merges file",
                f"Set {stage_key(ctx, 'download_merges_url')}=null",
            )

    def _output_prefix(self, ctx: StageContext) -> str:
        prefix = ctx.cfg.output_prefix
        if not isinstance(prefix, str) or not prefix or "/" in prefix:
            raise ConfigError(
                stage_key(ctx, "output_prefix"),
                f"{prefix!r} is not a file-name prefix",
                "Give one without '/', such as my-t5_",
            )
        return prefix

    @staticmethod
    def _check_array(ctx: StageContext, numbers: list[int]) -> None:
        """NeMo's `run.array` lists the shards as Slurm array indices; here the array's tasks
        share the shards of file_numbers, so it must name the same ones."""
        array = ctx.cfg.run.get("array")
        if array is None:
            return
        key = stage_key(ctx, "run.array")
        try:
            named = parse_file_numbers(array)
        except ValueError as error:
            raise ConfigError(key, str(error), "Use the syntax of file_numbers") from None
        if named != numbers:
            raise ConfigError(
                key,
                f"names the shards {array} but file_numbers names {ctx.cfg.file_numbers}",
                f"The array follows file_numbers: set {stage_key(ctx, 'file_numbers')}={array} "
                f"(run.node_array_size tasks share them)",
            )

    @staticmethod
    def _numbers(ctx: StageContext) -> list[int]:
        try:
            return parse_file_numbers(ctx.cfg.file_numbers)
        except ValueError as error:
            raise ConfigError(stage_key(ctx, "file_numbers"), str(error), "Fix the value") from None

    def _extracted(self, ctx: StageContext, number: int) -> Path:
        return Path(str(ctx.root.data_dir)) / self.shard_name.format(number).removesuffix(".zst")

    def jobs(self, ctx: StageContext) -> list[JobSpec]:
        cfg, name = ctx.cfg, str(ctx.cfg.run.name)
        data_dir, spec = str(ctx.root.data_dir), str(cfg.file_numbers)
        numbers = self._numbers(ctx)
        array = array_size(ctx, len(numbers))
        shards = ("--file-numbers", spec, "--name-format", self.shard_name)
        vocab, merges = self._tokenizer_files(ctx)
        downloaded = tuple(str(Path(data_dir) / self.shard_name.format(n)) for n in numbers)
        extracted = tuple(str(self._extracted(ctx, n)) for n in numbers)
        jobs = []
        if cfg.preprocess_data:
            files = ("--file", str(cfg.download_vocab_url), vocab)
            if merges:
                files += ("--file", str(cfg.download_merges_url), merges)
            saved = (vocab, merges) if merges else (vocab,)
            jobs.append(
                program_job(ctx, f"{name}-download_tokenizer", "download", files, None, saved)
            )
        if cfg.download_the_pile:
            args = ("--url-base", str(cfg.the_pile_url), *shards, "--output-dir", data_dir)
            jobs.append(program_job(ctx, f"{name}-download", "download", args, array, downloaded))
            args = ("--input-dir", data_dir, *shards, "--output-dir", data_dir)
            args += ("--remove-downloaded",) if cfg.rm_downloaded else ()
            jobs.append(
                program_job(ctx, f"{name}-extract", "extract", args, array, extracted, chained=True)
            )
        if cfg.preprocess_data:
            jobs.append(self._preprocess_job(ctx, extracted, numbers, vocab, merges, array))
        return jobs

    @staticmethod
    def _tokenizer_files(ctx: StageContext) -> tuple[str, str | None]:
        """Where the tokenizer's vocabulary (and merges, if its type has them) are saved."""
        cfg = ctx.cfg
        tokenizer = TOKENIZER_TYPES[cfg.tokenizer_type]
        vocab = str(Path(str(cfg.vocab_save_dir)) / tokenizer.vocab_name)
        merges = None
        if tokenizer.merges_name:
            merges = str(Path(str(cfg.merges_save_dir)) / tokenizer.merges_name)
        return vocab, merges

    def _outputs(self, ctx: StageContext, numbers: list[int]) -> tuple[str, ...]:
        data_dir, prefix = str(ctx.root.data_dir), self._output_prefix(ctx)
        # Megatron's names: sentence-split data ends in _sentence, other data in _document.
        level = "sentence" if ctx.cfg.split_sentences else "document"
        return tuple(str(Path(data_dir) / f"{prefix}{n:02d}_text_{level}") for n in numbers)

    def tokenized_with(self, ctx: StageContext) -> TokenizedWith:
        if not ctx.cfg.preprocess_data:
            return {}
        vocab, merges = self._tokenizer_files(ctx)
        files = {"vocab_file": vocab, **({"merge_file": merges} if merges else {})}
        return {output: files for output in self._outputs(ctx, self._numbers(ctx))}

    def _preprocess_job(
        self,
        ctx: StageContext,
        extracted: tuple[str, ...],
        numbers: list[int],
        vocab: str,
        merges: str | None,
        array: int,
    ) -> JobSpec:
        cfg, data_dir = ctx.cfg, str(ctx.root.data_dir)
        prefix = self._output_prefix(ctx)
        split = bool(ctx.cfg.split_sentences)
        args = ("--input", *extracted, "--output-dir", data_dir, "--output-prefix", prefix)
        args += ("--text-key", "text", "--vocab-file", vocab)
        args += ("--merge-file", merges) if merges else ()
        args += TOKENIZER_TYPES[cfg.tokenizer_type].flags
        args += ("--split-sentences",) if split else ()
        args += workers_args(ctx)
        args += ("--remove-inputs",) if cfg.rm_extracted else ()
        outputs = self._outputs(ctx, numbers)
        # Task i tokenizes exactly the shards extract task i wrote (both share by rank).
        chained = bool(cfg.download_the_pile)
        name = f"{cfg.run.name}-preprocess"
        return program_job(ctx, name, "preprocess", args, array, outputs, chained)


DATASETS: dict[str, Dataset] = {
    "custom_dataset": CustomDataset(),
    "pile": PileDataset(),
    "mc4": Mc4Dataset(),
    "sft_squad": SquadSftDataset(),
    "prompt_squad": PromptSquadDataset(),
    "sft_xquad": XquadSftDataset(),
    "sft_dolly": DollySftDataset(),
}


@register
class DataPreparation(StageDefaults):
    name = "data_preparation"
    declared_keys = (
        Declared(optional=("run.cpus_per_node",)),  # data_prep_common.cpu_resources
        # The table of languages: a user adds one with +<table>.<code>=COUNT.
        Declared(free_form=("language_file_counts",), when=(("dataset", "mc4"),)),
        # Split names are checked by the dataset, which lists the allowed ones.
        Declared(free_form=("split_fractions",), when=(("dataset", "sft_dolly"),)),
    )

    def _dataset(self, ctx: StageContext) -> Dataset:
        kind = ctx.cfg.get("dataset")
        require_choice(stage_key(ctx, "dataset"), kind, DATASETS)
        return DATASETS[kind]

    def validate(self, ctx: StageContext) -> None:
        self._dataset(ctx).validate(ctx)

    def jobs(self, ctx: StageContext) -> list[JobSpec]:
        return self._dataset(ctx).jobs(ctx)


def tokenized_with(root: DictConfig) -> TokenizedWith:
    """The indexed datasets the run's data_preparation stage writes, each with the tokenizer it
    is made with; none when the run has no such stage."""
    if DataPreparation.name not in root:
        return {}
    ctx = StageContext(root, DataPreparation.name)
    return DataPreparation()._dataset(ctx).tokenized_with(ctx)
