"""What the rest of the launcher asks of a model family, and the registry that answers.

A family is one module of this package (gpt, t5, bert) that registers a `ModelFamily`. The
stages, the plan, the job programs and the AutoConfigurator ask the family a recipe names
(`model_family`) instead of comparing names. Everything here is torch-free: preflight and dry
runs use it. The torch side of a family (its megatron-core model, datasets and forward step)
is the module named by `runtime`, which only job programs import.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher_scripts.config.checks import require_choice
from launcher_scripts.costmodel.plan import CostFunction, ShapeFunction, TrainingPlan, make_plan
from launcher_scripts.errors import ConfigError
from launcher_scripts.formats.portable_check import SHAPE_TABLES, ShapeTable, require_portable
from launcher_scripts.recipes.training import key
from launcher_scripts.recipes.tuning import TUNING_STAGES

Validator = Callable[[Any, str, Callable[[str], bool]], None]


@dataclass(frozen=True)
class Architecture:
    """A Hugging Face transformers class that holds a model exactly."""

    name: str  # the transformers class, written into config.json
    model_type: str  # transformers' model_type


def head_size_problem(model: Any) -> str | None:
    """What is wrong, for a Hugging Face config that derives the head size as hidden / heads
    (GPT-2, StableLM, Llama, BERT), with the model's kv_channels; None when nothing is."""
    channels, heads, hidden = model.get("kv_channels"), model.num_attention_heads, model.hidden_size
    if channels is not None and int(channels) * int(heads) != int(hidden):
        return f"{channels} per head x {heads} heads != hidden {hidden}"
    return None


# (the recipe's model section, the key to name in errors) -> its Hugging Face architecture, or
# ConfigError naming the key that rules every one out
ArchitectureOf = Callable[..., Architecture]

# (a converted base model's section, the tuning recipe's model section, the tuning layout,
# the stage, how to name the base in messages) -> None, or ConfigError naming the key that
# keeps the layout from holding the base
BaseCheck = Callable[[Any, Any, Any, str, str], None]

# What a job program may do with a family; `ModelFamily.programs` lists those this version has.
PROGRAMS = (
    "training",
    "training:restore",  # continued pretraining from a portable file (recipes/restore.py)
    "conversion",
    *TUNING_STAGES,
    "evaluation:harness",
    "evaluation:fine_tuned",
    "export",
    "hf_import",  # a local Hugging Face model directory to the portable file
)


@dataclass(frozen=True)
class ModelFamily:
    name: str  # the recipes' `model_family` value
    # The AutoConfigurator's model types and conf/ recipe folders of this family (mT5 is T5
    # with its own tokenizer and data).
    model_types: tuple[str, ...]
    validate: Validator  # a training recipe's checks, run in preflight
    # The model a recipe's `model` section describes, in numbers (recipes.model_shape's
    # ModelShape for a stack, costmodel.encoder_decoder's EncoderDecoderShape for T5): what
    # the plan, the AutoConfigurator and the job's FLOPs count read.
    shape: ShapeFunction
    costs: CostFunction  # parameters, memory and FLOPs of that shape at a layout
    encoder_decoder: bool
    pile_tokenizers: tuple[str, ...]  # the tokenizer types its Pile data is prepared with
    programs: frozenset[str]  # what this version's job programs do with it (PROGRAMS)
    hf_architecture: ArchitectureOf | None = None  # None: no Hugging Face export
    runtime: str | None = None  # the module of its torch side (jobs import it)
    check_base: BaseCheck | None = None  # for the tuning stages; None: they do not run it
    # What its portable file's model_config.yaml says the tensors' shapes are (checked before
    # a file is read); None: the file-level checks only.
    portable_shapes: ShapeTable | None = None
    # The Hugging Face config.json model_types it imports (with the hf_import program).
    hf_model_types: tuple[str, ...] = ()
    # config.json -> the import's model section (its architecture), or errors.HfImportError
    # naming the field it cannot import: the conversion stage's preflight asks it. None: the
    # import job alone checks the directory.
    hf_import_section: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # (the directory, its config.json) -> None, or errors.HfImportError naming the field, the
    # tensor and both values where the checkpoint's tensors or tokenizer disagree with the
    # config (families/hf_checkpoint.py); torch-free: preflight asks it, and the import job.
    hf_import_check: Callable[[Path, dict[str, Any]], None] | None = None
    # The module whose `import_hf(directory, config.json, its tensors (a safetensors_stream
    # TensorSource), the recipe's model section)` returns (our model section, our full tensors
    # as StreamedTensors, made a layer at a time). Apart from `runtime`: the import job needs
    # torch and the checkpoint's files, not megatron-core.
    hf_importer: str | None = None
    # Whether its training data is documents split into sentences (megatron-core's masked
    # datasets build samples from whole sentences), with no end-of-document token: what
    # data_preparation writes for a recipe of this family unless told otherwise.
    sentence_data: bool = False

    def runs(self, program: str) -> bool:
        assert program in PROGRAMS, program
        return program in self.programs

    def plan(self, root: Any, stage: str) -> TrainingPlan:
        """The plan of a training recipe of this family (root: the resolved configuration)."""
        return make_plan(root, stage, self.shape, self.costs)


FAMILIES: dict[str, ModelFamily] = {}
DEFAULT = "gpt"  # what a recipe without `model_family` is


def register(family: ModelFamily) -> ModelFamily:
    assert family.name not in FAMILIES, family.name
    unknown = family.programs - set(PROGRAMS)
    assert not unknown, unknown
    assert family.runs("hf_import") == (family.hf_importer is not None), family.name
    FAMILIES[family.name] = family
    if family.portable_shapes is not None:
        SHAPE_TABLES[family.name] = family.portable_shapes
    return family


# The model_family of a recipe whose model is a Hugging Face directory's, or a portable file's.
AUTO = "auto"


def family_of(cfg: Any, stage: str) -> ModelFamily:
    """The family of a stage's recipe; one line naming `<stage>.model_family` if unknown. An
    `auto` recipe's is the one that imports its `hf_model_dir`'s model_type, or the one its
    `nemo_file`'s model_config.yaml names."""
    name = cfg.get("model_family", DEFAULT)
    if name == AUTO and "nemo_file" in cfg:
        where = key(stage, "nemo_file")
        name = require_portable(
            str(cfg.nemo_file),
            where,
            f"Give a .nemo file the conversion, hf_import or fine_tuning stage wrote (or, for "
            f"one a stage of this run writes, set {key(stage, 'model_family')})",
        ).get("model_family", DEFAULT)
        require_choice(where + " model_family", name, FAMILIES)
    elif name == AUTO:
        return hf_family(cfg.get("hf_model_dir"), key(stage, "hf_model_dir"))
    require_choice(key(stage, "model_family"), name, FAMILIES)
    return FAMILIES[name]


def hf_family(directory: Any, where: str) -> ModelFamily:
    """The family importing a Hugging Face model directory, from its config.json."""
    config = Path(str(directory)) / "config.json"
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as error:
        raise ConfigError(
            where,
            f"{directory}: no readable config.json ({error.__class__.__name__})",
            "Give a local Hugging Face model directory (config.json, *.safetensors, tokenizer "
            "files), as save_pretrained writes it",
        ) from None
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family
    known = sorted(t for f in FAMILIES.values() for t in f.hf_model_types)
    raise ConfigError(
        where,
        f"{directory}: config.json's model_type {model_type!r} is not one this version imports",
        f"Import a model of one of: {', '.join(known)}",
    )


def model_types() -> tuple[str, ...]:
    return tuple(t for family in FAMILIES.values() for t in family.model_types)


def of_model_type(model_type: str) -> ModelFamily:
    return next(f for f in FAMILIES.values() if model_type in f.model_types)


def running(program: str) -> tuple[str, ...]:
    """The `model_family` values whose recipes a program runs."""
    return tuple(name for name, family in FAMILIES.items() if family.runs(program))


def family_mismatch(trained: Any, family: str, source: str) -> str | None:
    """What is wrong when a conversion recipe of `family` reads a model section of another
    family (training records its family in the section; older sections do not say)."""
    recorded = trained.get("model_family")
    if recorded is None or recorded == family:
        return None
    folder = FAMILIES[recorded].model_types[0] if recorded in FAMILIES else recorded
    return (
        f"{family}, but {source} is a {recorded} model: convert it with a {recorded} recipe, "
        f"e.g. conversion={folder}/convert_{folder}"
    )
