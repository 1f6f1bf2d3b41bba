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

from launcher_scripts.config.checks import require_int
from launcher_scripts.errors import RecipeError

# The tuning stages: each is a stage (stages/fine_tuning.py), a job program a family may run
# (families.PROGRAMS) and a config group of recipes (conf/<stage>/).
TUNING_STAGES = ("fine_tuning", "peft", "prompt_learning", "adapter_learning", "ia3_learning")
VIRTUAL_PROMPT_MARKER = "<|VIRTUAL_PROMPT_0|>"
PEFT_SCHEMES = ("lora", "adapter", "ia3", "ptuning", "prompt_tuning")
INIT_METHODS = ("xavier", "normal", "zero")
ADAPTER_ACTIVATIONS = ("swish", "silu", "gelu", "relu")
PROMPT_ENCODERS = ("mlp", "tpmlp")
# LoRA target -> (the transformer layer's module, its linear) that it adapts, as
# megatron-core names them (a portable file's keys: <stack>.layers.<module>.<linear>.weight)
LORA_LINEARS = {
    "attention_qkv": ("self_attention", "linear_qkv"),
    "attention_dense": ("self_attention", "linear_proj"),
    "mlp_fc1": ("mlp", "linear_fc1"),
    "mlp_fc2": ("mlp", "linear_fc2"),
    # An encoder-decoder's decoder: its cross-attention's query, key-value and output linears.
    "cross_attention_q": ("cross_attention", "linear_q"),
    "cross_attention_kv": ("cross_attention", "linear_kv"),
    "cross_attention_dense": ("cross_attention", "linear_proj"),
}
LORA_TARGET_NAMES = tuple(LORA_LINEARS)
CROSS_ATTENTION_TARGETS = tuple(t for t in LORA_TARGET_NAMES if t.startswith("cross_"))
PROMPT_STYLES = {"p-tuning": "ptuning", "prompt-tuning": "prompt_tuning"}

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
_ADAPTER_KEYS = ("activation", "layer_selection")
_PROMPT_ENCODER_KEYS = ("encoder_hidden", "bottleneck_dim", "num_layers", "encoder_type", "dropout")
# Keys this module and the tuning program read with a default that a stage's shipped recipes
# may leave out (the preflight's key check knows them from here), beyond the training loop's.
OPTIONAL_KEYS: dict[str, tuple[str, ...]] = {
    "common": (
        *(f"model.{name}" for name in LAYOUT_KEYS),
        "model.sequence_parallel",
    ),
    "fine_tuning": tuple(
        f"model.data.{split}_ds.{name}"
        for split in ("train", "validation", "test")
        for name in _SFT_SPLIT_KEYS
    ),
    "peft": (
        *(
            f"model.data.{split}_ds.{name}"
            for split in ("train", "validation", "test")
            for name in _SFT_SPLIT_KEYS
        ),
        *(f"model.peft.adapter_tuning.{name}" for name in _ADAPTER_KEYS),
        *(f"model.peft.p_tuning.{name}" for name in _PROMPT_ENCODER_KEYS),
    ),
    "prompt_learning": tuple(f"model.p_tuning.{name}" for name in _PROMPT_ENCODER_KEYS),
    "adapter_learning": tuple(f"model.adapter_tuning.{name}" for name in _ADAPTER_KEYS),
    "ia3_learning": (),
}


@dataclass(frozen=True)
class PeftSettings:
    """One method's settings, with the defaults NeMo documents."""

    scheme: str
    rank: int = 32  # LoRA rank and adapter bottleneck
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("attention_qkv",)
    column_init: str = "xavier"
    row_init: str = "zero"
    layer_selection: tuple[int, ...] | None = None  # 1-based layers; None: all
    norm_position: str | None = "pre"  # adapter: pre | post | None
    activation: str = "swish"
    virtual_tokens: int = 0
    encoder_hidden: int = 1024  # P-tuning MLP width
    encoder_layers: int = 2
    encoder_type: str = "mlp"
    init_std: float = 0.023

    def check(self, key: str) -> None:
        if self.scheme not in PEFT_SCHEMES:
            raise RecipeError(f"{key}: {self.scheme!r} is not one of {', '.join(PEFT_SCHEMES)}")
        unknown = [t for t in self.target_modules if t not in LORA_TARGET_NAMES]
        if self.scheme == "lora" and (unknown or not self.target_modules):
            raise RecipeError(
                f"{key}.target_modules: {list(self.target_modules)}: choose from "
                f"{', '.join(LORA_TARGET_NAMES)} (or all)"
            )
        if self.scheme in ("lora", "adapter") and self.rank < 1:
            raise RecipeError(f"{key}.adapter_dim must be at least 1, not {self.rank}")
        for name in (self.column_init, self.row_init):
            if name not in INIT_METHODS:
                raise RecipeError(f"{key}: init method {name!r} is not one of {INIT_METHODS}")
        if self.scheme in ("ptuning", "prompt_tuning") and self.virtual_tokens < 1:
            raise RecipeError(f"{key}: {self.scheme} needs at least one virtual token")
        if self.scheme == "ptuning" and self.encoder_type not in PROMPT_ENCODERS:
            raise RecipeError(
                f"{key}.p_tuning.encoder_type: {self.encoder_type!r}: this version has "
                f"{', '.join(PROMPT_ENCODERS)} (an MLP prompt encoder)"
            )
        if self.scheme == "ptuning" and self.encoder_layers < 1:
            raise RecipeError(f"{key}.num_layers: the prompt encoder needs at least one layer")
        if self.norm_position not in ("pre", "post", None):
            raise RecipeError(f"{key}.norm_position must be pre, post or null")
        if self.activation not in ADAPTER_ACTIVATIONS:
            raise RecipeError(f"{key}.activation must be one of {', '.join(ADAPTER_ACTIVATIONS)}")

    def check_layers(self, key: str, num_layers: int) -> None:
        if self.layer_selection is not None:
            bad = [n for n in self.layer_selection if not 1 <= n <= num_layers]
            if bad:
                raise RecipeError(
                    f"{key}.layer_selection: {bad} outside 1..{num_layers} (the base model's "
                    "layers, counted from 1)"
                )

    def chosen(self, layer_number: int) -> bool:
        return self.layer_selection is None or layer_number in self.layer_selection

    def as_dict(self) -> dict[str, Any]:
        values = dict(self.__dict__)
        values["target_modules"] = list(self.target_modules)
        if self.layer_selection is not None:
            values["layer_selection"] = list(self.layer_selection)
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PeftSettings:
        values = dict(values)
        values["target_modules"] = tuple(values.get("target_modules") or ())
        if values.get("layer_selection") is not None:
            values["layer_selection"] = tuple(values["layer_selection"])
        return cls(**values)


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
    method: str  # sft, or one of PEFT_SCHEMES
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


def _lora(section: Any, key: str) -> PeftSettings:
    targets = _plain(section.get("target_modules")) or ["attention_qkv"]
    if targets in ("all", ["all"]):
        targets = list(LORA_TARGET_NAMES)
    rank = require_int(f"{key}.adapter_dim", section.get("adapter_dim", 32))
    return PeftSettings(
        scheme="lora",
        rank=rank,
        alpha=float(section.get("alpha") or rank),
        dropout=float(section.get("adapter_dropout") or 0.0),
        target_modules=tuple(targets),
        column_init=str(section.get("column_init_method") or "xavier"),
        row_init=str(section.get("row_init_method") or "zero"),
        layer_selection=_layers(section),
    )


def _adapter(section: Any, key: str) -> PeftSettings:
    norm = section.get("norm_position", "pre")
    return PeftSettings(
        scheme="adapter",
        rank=require_int(f"{key}.adapter_dim", section.get("adapter_dim", 32)),
        dropout=float(section.get("adapter_dropout") or 0.0),
        column_init=str(section.get("column_init_method") or "xavier"),
        row_init=str(section.get("row_init_method") or "zero"),
        norm_position=None if norm in (None, "none") else str(norm),
        activation=str(section.get("activation") or "swish"),
        layer_selection=_layers(section),
    )


def _prompt(scheme: str, section: Any, tokens: int) -> PeftSettings:
    return PeftSettings(
        scheme=scheme,
        virtual_tokens=tokens,
        encoder_hidden=int(section.get("encoder_hidden") or section.get("bottleneck_dim") or 1024),
        encoder_layers=int(section.get("num_layers") or 2),
        encoder_type=str(section.get("encoder_type") or "mlp"),
        init_std=float(section.get("init_std") or 0.023),
        dropout=float(section.get("dropout") or 0.0),
    )


def _layers(section: Any) -> tuple[int, ...] | None:
    value = _plain(section.get("layer_selection"))
    return None if value is None else tuple(int(v) for v in value)


def _peft_stage(cfg: Any, stage: str) -> tuple[str, PeftSettings]:
    peft = cfg.model.peft
    scheme = str(peft.get("peft_scheme") or "")
    key = f"{stage}.model.peft"
    if scheme == "lora":
        return scheme, _lora(peft.get("lora_tuning") or {}, f"{key}.lora_tuning")
    if scheme == "adapter":
        return scheme, _adapter(peft.get("adapter_tuning") or {}, f"{key}.adapter_tuning")
    if scheme == "ia3":
        return scheme, PeftSettings("ia3", layer_selection=_layers(peft.get("ia3_tuning") or {}))
    if scheme in ("ptuning", "prompt_tuning"):
        section = peft.get("p_tuning") or {}
        tokens = require_int(f"{key}.p_tuning.virtual_tokens", section.get("virtual_tokens", 10))
        return scheme, _prompt(scheme, section, tokens)
    raise RecipeError(
        f"{key}.peft_scheme: {scheme!r} is not one of lora, ptuning, prompt_tuning, adapter, ia3"
    )


def read_spec(cfg: Any, stage: str) -> TuningSpec:
    model = cfg.model
    peft_restore: Path | None = None
    log_dir = Path(str(cfg.exp_manager.explicit_log_dir))
    # Where NeMo saves a tuning run's .nemo at the end: checkpoints/<exp_manager.name>.nemo
    output = log_dir / "checkpoints" / f"{cfg.exp_manager.get('name') or stage}.nemo"
    if stage in ("fine_tuning", "peft"):
        base_key = f"{stage}.model.restore_from_path"
        base = model.get("restore_from_path")
        train, validation, test = _sft_splits(cfg, stage)
        answer_only = bool(model.get("answer_only_loss", True))
        if stage == "peft":
            method, settings = _peft_stage(cfg, stage)
            restore = model.peft.get("restore_from_path")
            peft_restore = Path(str(restore)) if restore else None
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
        if stage == "prompt_learning":
            style = str(model.get("virtual_prompt_style") or "p-tuning")
            if style not in PROMPT_STYLES:
                raise RecipeError(
                    f"{stage}.model.virtual_prompt_style: {style!r} trains nothing; use "
                    f"{' or '.join(PROMPT_STYLES)}"
                )
            method = PROMPT_STYLES[style]
            tokens = int(task.get("total_virtual_tokens") or 0)
            source = model.get("p_tuning") if method == "ptuning" else {}
            settings = _prompt(method, source or {}, tokens)
        elif stage == "adapter_learning":
            method = "adapter"
            settings = _adapter(model.get("adapter_tuning") or {}, f"{stage}.model.adapter_tuning")
        else:
            method, settings = "ia3", PeftSettings("ia3")
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
