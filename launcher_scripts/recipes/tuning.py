"""What a fine-tuning recipe asks for, read the same way from every stage's recipe shape.

The fine_tuning and peft recipes describe data as `model.data.<split>_ds` sections (NeMo's SFT
layout); prompt_learning, adapter_learning and ia3_learning use the older layout: file lists
under `model.data` and one `task_templates` entry. Both become a TuningSpec. Pure Python: the
launcher's preflight and the job program read recipes through this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from launcher_scripts.errors import RecipeError
from launcher_scripts.tuning import (
    METHODS,
    PeftSettings,
    legacy_method,
    legacy_stages,
    method_named,
)

# The tuning stages: each is a stage (stages/fine_tuning.py), a job program a family may run
# (families.PROGRAMS) and a config group of recipes (conf/<stage>/).
TUNING_STAGES = ("fine_tuning", "peft", "prompt_learning", "adapter_learning", "ia3_learning")
VIRTUAL_PROMPT_MARKER = "<|VIRTUAL_PROMPT_0|>"
# The recipe keys that replace the base model's for the tuning run (finetune.training_cfg).
LAYOUT_KEYS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
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
_SFT_KEYS = tuple(
    f"model.data.{split}_ds.{name}"
    for split in ("train", "validation", "test")
    for name in _SFT_SPLIT_KEYS
)
OPTIONAL_KEYS: dict[str, tuple[str, ...]] = {
    "common": (
        *(f"model.{name}" for name in LAYOUT_KEYS),
        "model.sequence_parallel",
    ),
    "fine_tuning": _SFT_KEYS,
    "peft": (
        *_SFT_KEYS,
        *sorted(
            {
                f"model.peft.{method.section}.{name}"
                for method in METHODS.values()
                for name in method.optional_keys
            }
        ),
    ),
    # The older one-method stages: each method's keys in that stage's own section.
    **{
        stage: tuple(
            sorted(
                {
                    f"model.{method.legacy_section}.{name}"
                    for method in METHODS.values()
                    if method.legacy_stage == stage and method.legacy_section
                    for name in method.optional_keys
                }
            )
        )
        for stage in legacy_stages()
    },
}


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
    metric: str  # loss | exact_string_match
    tokens_to_generate: int
    output_file: Path  # PEFT weights, or the fine-tuned model for SFT
    peft_key: str = ""  # the recipe section holding the method's settings
    peft_restore_key: str = ""  # the recipe key naming the PEFT file to start from

    @property
    def virtual_tokens(self) -> int:
        return self.peft.virtual_tokens if self.peft else 0


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def file_list(key: str, value: Any, kind: str = "JSONL") -> tuple[Path, ...]:
    value = _plain(value)
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RecipeError(f"{key}: expected a list of {kind} file paths, got {value!r}")
    return tuple(Path(v) for v in value)


def _weights(key: str, value: Any, count: int) -> tuple[float, ...] | None:
    value = _plain(value)
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
    plain = _plain(section)
    return DataSplit(f"{key}.file_names", files, weights, plain, key, f"{key}.max_seq_length")


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
    names = _plain(section.get("names"))
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
        _plain(section),
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
    templates = _plain(model.get("task_templates")) or []
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


def _peft_stage(cfg: Any, stage: str) -> tuple[str, PeftSettings, str]:
    """The peft stage's method, its settings, and the key of their section."""
    peft = cfg.model.peft
    key = f"{stage}.model.peft"
    method = method_named(str(peft.get("peft_scheme") or ""), f"{key}.peft_scheme")
    section_key = f"{key}.{method.section}"
    return method.name, method.read(peft.get(method.section) or {}, section_key), section_key


def read_spec(cfg: Any, stage: str) -> TuningSpec:
    model = cfg.model
    peft_restore: Path | None = None
    peft_key = restore_key = ""
    log_dir = Path(str(cfg.exp_manager.explicit_log_dir))
    # Where NeMo saves a tuning run's .nemo at the end: checkpoints/<exp_manager.name>.nemo
    output = log_dir / "checkpoints" / f"{cfg.exp_manager.get('name') or stage}.nemo"
    if stage in ("fine_tuning", "peft"):
        base_key = f"{stage}.model.restore_from_path"
        base = model.get("restore_from_path")
        train, validation, test = _sft_splits(cfg, stage)
        answer_only = bool(model.get("answer_only_loss", True))
        if stage == "peft":
            method, settings, peft_key = _peft_stage(cfg, stage)
            restore = model.peft.get("restore_from_path")
            peft_restore = Path(str(restore)) if restore else None
            restore_key = f"{stage}.model.peft.restore_from_path"
        else:
            method, settings = "sft", None
        metric_section = (validation.section if validation else {}).get("metric") or {}
        metric = str(metric_section.get("name") or "loss")
        # Text to text generates up to the answers' length unless told.
        longest = validation.max_target_length if validation else None
        section = validation.section if validation else {}
        tokens = int(section.get("tokens_to_generate") or longest or 32)
    else:
        base_key = f"{stage}.model.language_model_path"
        base = model.get("language_model_path")
        train, validation, test = _template_splits(cfg, stage)
        answer_only = bool(train.section["answer_only_loss"])
        task = (_plain(model.get("task_templates")) or [{}])[0]
        chosen = legacy_method(
            stage,
            str(model.get("virtual_prompt_style") or "p-tuning"),
            f"{stage}.model.virtual_prompt_style",
        )
        section = model.get(chosen.legacy_section) if chosen.legacy_section else None
        # The task template counts the virtual tokens (methods without them ignore it).
        values = dict(_plain(section) or {})
        values["virtual_tokens"] = int(task.get("total_virtual_tokens") or 0)
        peft_key = f"{stage}.model" + (f".{chosen.legacy_section}" if section else "")
        method, settings = chosen.name, chosen.read(values, peft_key)
        restore_key = f"{stage}.model.restore_path"
        restore = model.get("restore_path")
        peft_restore = Path(str(restore)) if restore else None
        if model.get("nemo_path"):
            output = Path(str(model.nemo_path))
        metric, tokens = "loss", 32
    if not base:
        raise RecipeError(f"{base_key}: give the base model (the conversion stage's .nemo file)")
    if settings is not None:
        settings.check(f"{stage}.model.peft" if stage == "peft" else f"{stage}.model")
    if metric not in ("loss", "exact_string_match"):
        raise RecipeError(
            f"{stage}.model.data.validation_ds.metric.name: {metric!r}; this version computes "
            "loss and exact_string_match"
        )
    return TuningSpec(
        stage=stage,
        method=method,
        base_model=Path(str(base)),
        base_key=base_key,
        peft=settings,
        peft_restore=peft_restore,
        answer_only_loss=answer_only,
        train=train,
        validation=validation,
        test=test,
        metric=metric,
        tokens_to_generate=tokens,
        output_file=output,
        peft_key=peft_key,
        peft_restore_key=restore_key,
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
            inputs += [(f"{split.key}[{i}]", path) for i, path in enumerate(split.files)]
            inputs += [(f"{split.target_key}[{i}]", p) for i, p in enumerate(split.targets)]
    return inputs
