"""What a fine-tuning recipe asks for, read the same way from every stage's recipe shape.

Each tuning stage is a `TuningStageSpec` (TUNING_STAGE_SPECS): its data layout, how its
recipe names what it trains and the training task its job runs. The fine_tuning and peft
recipes describe data as `model.data.<split>_ds` sections (NeMo's SFT layout);
prompt_learning, adapter_learning and ia3_learning use the older layout: file lists under
`model.data` and one `task_templates` entry; rlhf_rm the reference's reward-model layout
(`model.data.data_prefix` of preference pairs). fine_tuning tunes every weight, peft the
method of its `model.peft` section, the older stages the method registered for them
(launcher_scripts/tuning/), rlhf_rm every weight or a method that merges into them. All
become a TuningSpec.
Pure Python: the launcher's preflight and the job program read recipes through this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from launcher_scripts.errors import RecipeError
from launcher_scripts.formats.preference import preference_problem
from launcher_scripts.formats.prompt import prompt_problem
from launcher_scripts.recipes.answer_metrics import AnswerMetric, read_metric
from launcher_scripts.recipes.grpo import GRPO_KEYS, read_grpo
from launcher_scripts.recipes.ppo import RLHF_KEYS, read_ppo
from launcher_scripts.recipes.preference import DPO_KEYS, read_dpo
from launcher_scripts.tuning import (
    METHODS,
    PeftMethod,
    PeftSettings,
    legacy_method,
    method_named,
)
from launcher_scripts.tuning.method import plain

VIRTUAL_PROMPT_MARKER = "<|VIRTUAL_PROMPT_0|>"
# The recipe keys that replace the base model's for the tuning run (finetune.training_cfg).
LAYOUT_KEYS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",  # a mixture of experts' (recipes/layout.py)
    "expert_tensor_parallel_size",
    "micro_batch_size",
    "global_batch_size",
    "seed",
    "hidden_dropout",
    "attention_dropout",
    "activations_checkpoint_granularity",
    "activations_checkpoint_method",
    "activations_checkpoint_num_layers",
    "pipeline_model_parallel_split_rank",
)
# An encoder-decoder's per-block sections, whose keys override the model's own.
BLOCK_SECTIONS = ("encoder", "decoder")
_SFT_SPLIT_KEYS = ("answer_only_loss",)  # read for every split (tuner.py), set for none
# Keys this module and the tuning program read with a default that a stage's shipped recipes
# may leave out (the preflight's key check knows them from here), beyond the training loop's.
_SFT_KEYS = (
    *(
        f"model.data.{split}_ds.{name}"
        for split in ("train", "validation", "test")
        for name in _SFT_SPLIT_KEYS
    ),
    # The validation metric's classification keys (answer_metrics.read_metric).
    *(
        f"model.data.validation_ds.metric.{name}"
        for name in ("average", "num_classes", "class_labels", "labels_are_strings")
    ),
)


@dataclass(frozen=True)
class DataSplit:
    key: str  # the recipe key that names the files, for messages
    files: tuple[Path, ...]
    weights: tuple[float, ...] | None  # None with several files: temperature sampling
    section: dict[str, Any]  # what SftFormat.from_section reads
    format_key: str  # the recipe section the format's keys come from, for messages
    length_key: str  # the recipe key of max_seq_length (text to text: of the inputs)
    # Text-to-text data (T5's layout): line i of targets[k] answers line i of files[k].
    targets: tuple[Path, ...] = ()
    target_key: str = ""
    names: tuple[str, ...] | None = None  # one per file, naming its metrics
    temperature: float = 1.0  # several files, no weights: p ~ records^(1/temperature)
    # The JSONL records' format (RECORD_PROBLEMS' keys; "" for SFT's own): "preference" pairs
    # may also be data_preparation's indexed files by their prefix (PREFIX.bin and PREFIX.idx).
    record_format: str = ""

    @property
    def preference(self) -> bool:
        return self.record_format == "preference"

    def inputs(self) -> list[tuple[str, Path]]:
        """(recipe key, path) of each file this split reads."""
        found = []
        for index, path in enumerate(self.files):
            key = f"{self.key}[{index}]"
            if self.preference and not is_jsonl(path):
                found += [(key, Path(f"{path}{suffix}")) for suffix in (".bin", ".idx")]
            else:
                found.append((key, path))
        found += [(f"{self.target_key}[{i}]", p) for i, p in enumerate(self.targets)]
        return found

    @property
    def max_seq_length(self) -> int:
        value = self.section.get("max_seq_length") or self.section.get("max_src_seq_length")
        return int(value or 2048)

    @property
    def max_target_length(self) -> int | None:
        """The decoder's length, for text-to-text data (None: one sequence holds both)."""
        value = self.section.get("max_tgt_seq_length")
        return int(value) if value else None


@dataclass(frozen=True)
class TuningSpec:
    stage: str
    method: str  # sft, or a PEFT method's name (launcher_scripts/tuning/)
    base_model: Path
    base_key: str
    peft: PeftSettings | None
    peft_restore: Path | None
    answer_only_loss: bool
    train: DataSplit
    validation: DataSplit | None
    test: DataSplit | None
    metric: AnswerMetric  # how the validation answers are scored
    tokens_to_generate: int
    output_file: Path  # PEFT weights, or the fine-tuned model for SFT
    peft_key: str = ""  # the recipe section holding the method's settings
    peft_restore_key: str = ""  # the recipe key naming the PEFT file to start from
    task: str = "sft"  # the training task its job runs (TuningStageSpec.task)
    objective: Any = None  # the task's own settings (TuningStageSpec.objective), or None

    @property
    def virtual_tokens(self) -> int:
        return self.peft.virtual_tokens if self.peft else 0


def is_jsonl(path: Path) -> bool:
    return path.suffix in (".jsonl", ".json")


def file_list(key: str, value: Any, kind: str = "JSONL") -> tuple[Path, ...]:
    value = plain(value)
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RecipeError(f"{key}: expected a list of {kind} file paths, got {value!r}")
    return tuple(Path(v) for v in value)


def _weights(key: str, value: Any, count: int) -> tuple[float, ...] | None:
    value = plain(value)
    if value is None:
        if count > 1:
            raise RecipeError(f"{key}: {count} files need one sampling weight each (summing to 1)")
        return None
    if not isinstance(value, list) or len(value) != count:
        raise RecipeError(f"{key}: give one weight per file ({count}), got {value!r}")
    weights = tuple(float(v) for v in value)
    if any(w < 0 for w in weights) or abs(sum(weights) - 1) > 1e-6:
        raise RecipeError(f"{key}: {list(weights)} must be non-negative and sum to 1")
    return weights


def _sft_splits(cfg: Any, stage: str) -> tuple[DataSplit, DataSplit | None, DataSplit | None]:
    data = cfg.model.data
    splits: list[DataSplit | None] = []
    for name in ("train_ds", "validation_ds", "test_ds"):
        section = data.get(name)
        key = f"{stage}.model.data.{name}"
        text_to_text = section is not None and "src_file_name" in section
        splits.append(
            _text_to_text_split(section, key, name == "train_ds")
            if text_to_text
            else _jsonl_split(section, key, name == "train_ds")
        )
    train, validation, test = splits
    if train is None:
        raise RecipeError(
            f"{stage}.model.data.train_ds.file_names: give the training JSONL files (or, as "
            "text to text, src_file_name and tgt_file_name)"
        )
    return train, validation, test


def _jsonl_split(section: Any, key: str, training: bool) -> DataSplit | None:
    files = file_list(f"{key}.file_names", section.get("file_names") if section else None)
    if not files:
        return None
    weights = (
        _weights(
            f"{key}.concat_sampling_probabilities",
            section.get("concat_sampling_probabilities"),
            len(files),
        )
        if training
        else None
    )
    values = plain(section)
    return DataSplit(f"{key}.file_names", files, weights, values, key, f"{key}.max_seq_length")


def text_pairs(section: Any, key: str) -> tuple[tuple[Path, ...], tuple[Path, ...]]:
    """A section's `src_file_name` and `tgt_file_name` (a file each, or lists): one target file
    per source file."""
    sources = file_list(f"{key}.src_file_name", section.get("src_file_name"), "text")
    targets = file_list(f"{key}.tgt_file_name", section.get("tgt_file_name"), "text")
    if len(targets) != len(sources):
        raise RecipeError(
            f"{key}.tgt_file_name: {len(targets)} target files for {len(sources)} source files: "
            "give one target file per source file, in the same order"
        )
    return sources, targets


def _text_to_text_split(section: Any, key: str, training: bool) -> DataSplit | None:
    """`src_file_name`/`tgt_file_name` (a file each, or lists of equal length): inputs and
    their answers line by line."""
    sources, targets = text_pairs(section, key)
    if not sources:
        return None
    names = plain(section.get("names"))
    if names is not None:
        if not isinstance(names, list) or len(names) != len(sources):
            raise RecipeError(
                f"{key}.names: {names!r}: give one name per source file ({len(sources)}), or null"
            )
        names = tuple(str(n) for n in names)
    weights, temperature = None, 1.0
    if training and len(sources) > 1:
        technique = str(section.get("concat_sampling_technique") or "temperature")
        if technique == "random":
            weights = _weights(
                f"{key}.concat_sampling_probabilities",
                section.get("concat_sampling_probabilities"),
                len(sources),
            )
        elif technique == "temperature":
            temperature = float(section.get("concat_sampling_temperature") or 1.0)
            if temperature <= 0:
                raise RecipeError(
                    f"{key}.concat_sampling_temperature: {temperature} must be above 0 "
                    "(1: in proportion to the files' sizes; larger: closer to uniform)"
                )
        else:
            raise RecipeError(
                f"{key}.concat_sampling_technique: {technique!r} is not temperature or random"
            )
    return DataSplit(
        f"{key}.src_file_name",
        sources,
        weights,
        plain(section),
        key,
        f"{key}.max_src_seq_length",
        targets=targets,
        target_key=f"{key}.tgt_file_name",
        names=names,
        temperature=temperature,
    )


def _template_splits(cfg: Any, stage: str) -> tuple[DataSplit, DataSplit | None, DataSplit | None]:
    """The prompt_learning-style layout: one task template, file lists under model.data."""
    model = cfg.model
    templates = plain(model.get("task_templates")) or []
    if not templates:
        raise RecipeError(f"{stage}.model.task_templates: give one task template")
    task = templates[0]
    answer = str(task.get("answer_field") or "answer")
    template = str(task.get("prompt_template") or "").replace(VIRTUAL_PROMPT_MARKER, "")
    truncate = task.get("truncate_field")
    section = {
        "prompt_template": template.lstrip(),
        "label_key": answer,
        "context_key": str(truncate or "input"),
        "max_seq_length": int(model.get("encoder_seq_length") or 2048),
        # An encoder-decoder's recipe bounds the answer apart (the decoder's length).
        "max_tgt_seq_length": model.get("decoder_seq_length"),
        "add_eos": bool(model.data.get("add_eos", True)),
        "truncation_field": "answer" if truncate == answer else "context",
        "answer_only_loss": bool(task.get("answer_only_loss", True)),
        "shuffle": bool(model.data.get("shuffle", True)),
    }
    splits: list[DataSplit | None] = []
    template_key = f"{stage}.model.task_templates[0]"
    length_key = f"{stage}.model.encoder_seq_length"
    for name in ("train_ds", "validation_ds", "test_ds"):
        key = f"{stage}.model.data.{name}"
        files = file_list(key, model.data.get(name))
        weights = None
        if files and name == "train_ds" and len(files) > 1:
            weights = tuple(1 / len(files) for _ in files)
        split = DataSplit(key, files, weights, section, template_key, length_key)
        splits.append(split if files else None)
    train, validation, test = splits
    if train is None:
        raise RecipeError(f"{stage}.model.data.train_ds: give the training JSONL files")
    return train, validation, test


# ---------------------------------------------------------------------------------------------
# The tuning stages: what each reads (its data layout) and how it names what it trains.


@dataclass(frozen=True)
class StageData:
    """What a stage's data layout reads from its recipe."""

    base_key: str
    base: Any
    train: DataSplit
    validation: DataSplit | None
    test: DataSplit | None
    answer_only_loss: bool
    metric: AnswerMetric
    tokens_to_generate: int
    output_file: Path


@dataclass(frozen=True)
class Trained:
    """What a stage's recipe tunes: every weight (no method), or a PEFT method's modules."""

    method: str  # sft, or a PEFT method's name
    settings: PeftSettings | None = None
    peft_key: str = ""  # the recipe section of the method's settings
    restore: Path | None = None  # a PEFT file to start from
    restore_key: str = ""
    settings_key: str = ""  # what the settings' messages name


@dataclass(frozen=True)
class TuningStageSpec:
    """One tuning stage: a stage (stages/fine_tuning.py), a job program a family may run
    (families.PROGRAMS) and a config group of recipes (conf/<stage>/)."""

    name: str
    read_data: Callable[[Any, str, Path], StageData]  # (cfg, stage, default output)
    trained: Callable[[Any, str], Trained]  # (cfg, stage)
    # Keys its reader and the tuning program read with a default that the stage's shipped
    # recipes may leave out (the preflight's key check knows them from here).
    optional_keys: tuple[str, ...] = ()
    # The training task its job runs (jobs/fine_tuning/tasks.py): sft (supervised answers),
    # reward_model (a scalar head and the pairwise ranking loss), dpo (direct preference
    # optimisation against a frozen reference), grpo (group-relative policy optimisation
    # on the policy's own sampled completions) or ppo (PPO with a critic and a reward model).
    task: str = "sft"
    # (cfg, stage) -> the task's own settings (the DPO loss's), read and checked; None: none
    objective: Callable[[Any, str], Any] | None = None
    packs: bool = True  # whether its task packs several examples in a sequence


def _sft_layout(cfg: Any, stage: str, output: Path) -> StageData:
    """`model.data.<split>_ds` sections (NeMo's SFT layout), the base in restore_from_path."""
    model = cfg.model
    train, validation, test = _sft_splits(cfg, stage)
    section = validation.section if validation else {}
    metric = read_metric(section.get("metric"), f"{stage}.model.data.validation_ds.metric")
    # Text to text generates up to the answers' length unless told.
    longest = validation.max_target_length if validation else None
    return StageData(
        base_key=f"{stage}.model.restore_from_path",
        base=model.get("restore_from_path"),
        train=train,
        validation=validation,
        test=test,
        answer_only_loss=bool(model.get("answer_only_loss", True)),
        metric=metric,
        tokens_to_generate=int(section.get("tokens_to_generate") or longest or 32),
        output_file=output,
    )


def _template_layout(cfg: Any, stage: str, output: Path) -> StageData:
    """The older layout: file lists under `model.data`, one `task_templates` entry, the base
    in language_model_path; `nemo_path` names the output."""
    model = cfg.model
    train, validation, test = _template_splits(cfg, stage)
    return StageData(
        base_key=f"{stage}.model.language_model_path",
        base=model.get("language_model_path"),
        train=train,
        validation=validation,
        test=test,
        answer_only_loss=bool(train.section["answer_only_loss"]),
        metric=AnswerMetric("loss"),
        tokens_to_generate=32,
        output_file=Path(str(model.nemo_path)) if model.get("nemo_path") else output,
    )


def _every_weight(cfg: Any, stage: str) -> Trained:
    del cfg, stage
    return Trained("sft")


def _peft_section(cfg: Any, stage: str) -> Trained:
    """`model.peft`: the method its `peft_scheme` names, its settings in their section."""
    peft = cfg.model.peft
    key = f"{stage}.model.peft"
    method = method_named(str(peft.get("peft_scheme") or ""), f"{key}.peft_scheme")
    section_key = f"{key}.{method.section}"
    restore = peft.get("restore_from_path")
    return Trained(
        method.name,
        method.read(peft.get(method.section) or {}, section_key),
        section_key,
        Path(str(restore)) if restore else None,
        f"{key}.restore_from_path",
        key,
    )


def _older_stage(cfg: Any, stage: str) -> Trained:
    """The method registered for this older stage (prompt_learning: the one its
    virtual_prompt_style names), its settings in the stage's own section."""
    model = cfg.model
    chosen = legacy_method(
        stage,
        str(model.get("virtual_prompt_style") or "p-tuning"),
        f"{stage}.model.virtual_prompt_style",
    )
    section = model.get(chosen.legacy_section) if chosen.legacy_section else None
    task = (plain(model.get("task_templates")) or [{}])[0]
    # The task template counts the virtual tokens (methods without them ignore it).
    values = dict(plain(section) or {})
    values["virtual_tokens"] = int(task.get("total_virtual_tokens") or 0)
    peft_key = f"{stage}.model" + (f".{chosen.legacy_section}" if section else "")
    restore = model.get("restore_path")
    return Trained(
        chosen.name,
        chosen.read(values, peft_key),
        peft_key,
        Path(str(restore)) if restore else None,
        f"{stage}.model.restore_path",
        f"{stage}.model",
    )


def _data_prefix_layout(record_format: str, cfg: Any, stage: str, output: Path) -> StageData:
    """The reference's reward-model layout: `model.data.data_prefix` {train, validation,
    test}, each a list of record files, the base in `model.pretrained_checkpoint
    .restore_from_path`. Preference pairs (rlhf_rm, dpo): data_preparation's indexed prefixes,
    whose consecutive documents are a prompt with its chosen answer, then with its rejected
    one; or JSONL of {"prompt", "chosen", "rejected"}. Prompts (grpo, rlhf_ppo): JSONL of
    {"prompt", and the fields its rewards read}."""
    model = cfg.model
    data = model.get("data") or {}
    key = f"{stage}.model.data.data_prefix"
    prefixes = plain(data.get("data_prefix"))
    if not isinstance(prefixes, dict):
        raise RecipeError(
            f"{key}: {prefixes!r}: give {{train: [files], validation: [files], test: [files]}}"
        )
    unknown = sorted(set(prefixes) - {"train", "validation", "test"})
    if unknown:
        raise RecipeError(f"{key}: {unknown} are not splits: use train, validation and test")
    length_key = f"{stage}.model.data.seq_length"
    section = {
        "max_seq_length": int(data.get("seq_length") or model.get("encoder_seq_length")),
        "packed_sequence": bool(data.get("packed_sequence", False)),
    }
    splits: list[DataSplit | None] = []
    for name in ("train", "validation", "test"):
        files = file_list(f"{key}.{name}", prefixes.get(name), record_format)
        split = DataSplit(
            f"{key}.{name}", files, None, section, key, length_key, record_format=record_format
        )
        splits.append(split if files else None)
    train, validation, test = splits
    if train is None:
        raise RecipeError(f"{key}.train: give the training {record_format} files")
    base = (model.get("pretrained_checkpoint") or {}).get("restore_from_path")
    return StageData(
        base_key=f"{stage}.model.pretrained_checkpoint.restore_from_path",
        base=base,
        train=train,
        validation=validation,
        test=test,
        answer_only_loss=False,
        metric=AnswerMetric("loss"),
        tokens_to_generate=0,
        output_file=output,
    )


def _merging_method(cfg: Any, stage: str) -> Trained:
    """Every weight, or the `model.peft` method when it folds into them (a reward model is
    written whole, its head with it): `peft_scheme` none (or no section) for every weight."""
    peft = cfg.model.get("peft")
    scheme = str((peft or {}).get("peft_scheme") or "none")
    if scheme.lower() == "none":
        return Trained("sft")
    key = f"{stage}.model.peft.peft_scheme"
    if not method_named(scheme, key).merges:
        merging = [m.name for m in METHODS.values() if m.merges]
        raise RecipeError(
            f"{key}: {scheme!r} does not fold into the weights, and this stage writes a "
            f"whole model: use none or {' or '.join(merging)}"
        )
    return _peft_section(cfg, stage)


def _method_keys(section_of: Callable[[PeftMethod], str | None]) -> tuple[str, ...]:
    """Each method's optional keys, under the model section `section_of` names for it (None:
    a section this stage does not read)."""
    return tuple(
        sorted(
            {
                f"model.{section}.{name}"
                for method in METHODS.values()
                if (section := section_of(method))
                for name in method.optional_keys
            }
        )
    )


def _older_stage_keys(stage: str) -> tuple[str, ...]:
    """Each of the stage's methods' keys, in the stage's own section."""
    return _method_keys(lambda m: m.legacy_section if m.legacy_stage == stage else None)


_PEFT_SECTION_KEYS = _method_keys(lambda method: f"peft.{method.section}")
_PREFERENCE_KEYS = (
    "model.data.packed_sequence",
    "model.data.data_prefix.validation",
    "model.data.data_prefix.test",
    "model.encoder_seq_length",
    "model.peft.peft_scheme",
    "model.peft.restore_from_path",
    *_method_keys(lambda method: f"peft.{method.section}" if method.merges else None),
)
TUNING_STAGE_SPECS: dict[str, TuningStageSpec] = {
    spec.name: spec
    for spec in (
        TuningStageSpec("fine_tuning", _sft_layout, _every_weight, _SFT_KEYS),
        TuningStageSpec("peft", _sft_layout, _peft_section, (*_SFT_KEYS, *_PEFT_SECTION_KEYS)),
        *(
            TuningStageSpec(name, _template_layout, _older_stage, _older_stage_keys(name))
            for name in ("prompt_learning", "adapter_learning", "ia3_learning")
        ),
        TuningStageSpec(
            "rlhf_rm",
            partial(_data_prefix_layout, "preference"),
            _merging_method,
            _PREFERENCE_KEYS,
            "reward_model",
            packs=False,
        ),
        TuningStageSpec(
            "dpo",
            partial(_data_prefix_layout, "preference"),
            _merging_method,
            (*_PREFERENCE_KEYS, *(f"model.dpo.{name}" for name in DPO_KEYS)),
            "dpo",
            read_dpo,
        ),
        TuningStageSpec(
            "grpo",
            partial(_data_prefix_layout, "prompt"),
            _merging_method,
            (*_PREFERENCE_KEYS, *(f"model.grpo.{name}" for name in GRPO_KEYS)),
            "grpo",
            read_grpo,
            packs=False,
        ),
        TuningStageSpec(
            "rlhf_ppo",
            partial(_data_prefix_layout, "prompt"),
            _merging_method,
            (*_PREFERENCE_KEYS, *(f"model.{name}" for name in RLHF_KEYS)),
            "ppo",
            read_ppo,
            packs=False,
        ),
    )
}
TUNING_STAGES = tuple(TUNING_STAGE_SPECS)
# The stages that tune a model to answer (any family with a tuning side runs them).
SFT_STAGES = tuple(name for name, spec in TUNING_STAGE_SPECS.items() if spec.task == "sft")
# Keys every tuning stage reads with a default, and each stage's own (OPTIONAL_KEYS[stage]).
OPTIONAL_KEYS: dict[str, tuple[str, ...]] = {
    "common": (*(f"model.{name}" for name in LAYOUT_KEYS), "model.sequence_parallel"),
    **{name: spec.optional_keys for name, spec in TUNING_STAGE_SPECS.items()},
}


def read_spec(cfg: Any, stage: str) -> TuningSpec:
    spec = TUNING_STAGE_SPECS[stage]
    log_dir = Path(str(cfg.exp_manager.explicit_log_dir))
    # Where NeMo saves a tuning run's .nemo at the end: checkpoints/<exp_manager.name>.nemo
    output = log_dir / "checkpoints" / f"{cfg.exp_manager.get('name') or stage}.nemo"
    data = spec.read_data(cfg, stage, output)
    trained = spec.trained(cfg, stage)
    if not data.base:
        raise RecipeError(
            f"{data.base_key}: give the base model (the conversion stage's .nemo file)"
        )
    if trained.settings is not None:
        trained.settings.check(trained.settings_key)
    if data.train.section.get("packed_sequence") and not spec.packs:
        raise RecipeError(
            f"{data.train.format_key.rsplit('.', 1)[0]}.packed_sequence: {stage} does not pack "
            "sequences in this version: set it to false"
        )
    return TuningSpec(
        stage=stage,
        method=trained.method,
        base_model=Path(str(data.base)),
        base_key=data.base_key,
        peft=trained.settings,
        peft_restore=trained.restore,
        answer_only_loss=data.answer_only_loss,
        train=data.train,
        validation=data.validation,
        test=data.test,
        metric=data.metric,
        tokens_to_generate=data.tokens_to_generate,
        output_file=data.output_file,
        peft_key=trained.peft_key,
        peft_restore_key=trained.restore_key,
        task=spec.task,
        objective=spec.objective(cfg, stage) if spec.objective is not None else None,
    )


def most_layers(model: Any) -> int:
    """The layers of the model's longest stack (an encoder-decoder's blocks count their own
    layers from 1, and `layer_selection` picks in each)."""
    stacks = [model[block] for block in BLOCK_SECTIONS if block in model] or [model]
    return max(int(stack.num_layers) for stack in stacks)


def check_positions(spec: TuningSpec, base: Any) -> None:
    """The training sequences (text to text: inputs and answers) fit the base model's position
    embeddings. A relative position bias (T5's) has distance buckets, not a length."""
    if base.get("position_embedding_type") == "relative":
        return
    positions = int(base.max_position_embeddings)
    lengths = [(spec.train.length_key, spec.train.max_seq_length)]
    if spec.train.max_target_length is not None:
        lengths.append(
            (f"{spec.train.format_key}.max_tgt_seq_length", spec.train.max_target_length)
        )
    for name, wanted in lengths:
        if wanted > positions:
            raise RecipeError(
                f"{name}: {wanted} exceeds the base model's {positions} positions: "
                f"set it to {positions} or less"
            )


def all_inputs(spec: TuningSpec) -> list[tuple[str, Path]]:
    """(recipe key, path) of every file the job reads."""
    inputs = [(spec.base_key, spec.base_model)]
    if spec.peft_restore:
        inputs.append((f"{spec.stage} PEFT restore path", spec.peft_restore))
    for split in (spec.train, spec.validation, spec.test):
        if split is not None:
            inputs += split.inputs()
    return inputs + objective_models(spec) + reward_models(spec)


def objective_models(spec: TuningSpec) -> list[tuple[str, Path]]:
    """The model files the task's settings name beside the base that must be its twins (a DPO
    reference)."""
    models = getattr(spec.objective, "models", None)
    return models() if models is not None else []


def served_roles(spec: TuningSpec) -> list[tuple[str, int]]:
    """(role, processes) of the jobs that serve the task's other models beside its own (PPO's
    servers layout): its stage starts them as the job's companions."""
    served = getattr(spec.objective, "served", None)
    return served() if served is not None else []


def reward_models(spec: TuningSpec) -> list[tuple[str, Path]]:
    """The reward models the task's settings score with (GRPO's): each must share the base's
    tokenizer."""
    models = getattr(spec.objective, "reward_models", None)
    return models() if models is not None else []


# What is wrong with a record of each JSONL format a split may name (None: nothing).
RECORD_PROBLEMS: dict[str, Callable[[Any], str | None]] = {
    "preference": preference_problem,
    "prompt": prompt_problem,
}


def check_record_files(spec: TuningSpec) -> None:
    """Each existing JSONL file of a preference or prompt layout, record by record:
    RecipeError naming the first bad line (a missing answer, chosen equal to rejected...),
    before any job."""
    import json

    for split in (spec.train, spec.validation, spec.test):
        if split is None or split.record_format not in RECORD_PROBLEMS:
            continue
        problem_of = RECORD_PROBLEMS[split.record_format]
        for index, path in enumerate(split.files):
            if not is_jsonl(path) or not path.is_file():
                continue
            with path.open(encoding="utf-8") as lines:
                for number, line in enumerate(lines, 1):
                    if not line.strip():
                        continue
                    try:
                        problem = problem_of(json.loads(line))
                    except json.JSONDecodeError as error:
                        problem = f"not JSON ({error.msg})"
                    if problem is not None:
                        writer = (
                            " (preference_convert writes valid files)" if split.preference else ""
                        )
                        raise RecipeError(
                            f"{split.key}[{index}]: {path}:{number}: {problem}. Fix or drop "
                            f"the record{writer}"
                        )
