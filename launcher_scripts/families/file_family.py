"""The family a portable model file or a PEFT file holds, and the one check every reader of
such a file makes before using it: a recipe of another family, or a PEFT file tuned on a base
of another family, is refused in one line that names the file, its family and architecture,
what the recipe expects, and the shipped recipes that do take the file.

The files record their family: a portable file's model_config.yaml has `model_family` (files
of versions that converted decoder stacks only have none: GPT), a PEFT file's
peft_config.yaml the family and architecture of the base it was tuned on (`peft_record`;
files written before it said have only the base's path, read when it is still there).

Torch-free: the stages' preflights, the job programs and the merge-lora command use it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from launcher_scripts.errors import ConfigError
from launcher_scripts.families.base import DEFAULT, FAMILIES, ModelFamily
from launcher_scripts.formats.portable import REWARD_MODEL
from launcher_scripts.formats.portable_check import PortableFileError, inspect_portable
from launcher_scripts.recipes.tuning import TUNING_STAGE_SPECS

# A shipped recipe's top-level keys -> whether it takes a whole model's file of the family.
RecipeTest = Callable[[dict[str, Any], ModelFamily], bool]


@dataclass(frozen=True)
class Reader:
    """What a recipe does with a model file: the config group of such recipes, the verb for
    messages, and which of that group's recipes take a file of a given family."""

    group: str
    verb: str  # "this recipe <verb> gpt ones"
    takes: RecipeTest
    # Whether it reads a reward model's file (a scalar head, no output layer) too.
    scores: bool = False


def _of_family(program: str, **keys: Any) -> RecipeTest:
    """Recipes of the file's family, for a program the family runs, with these keys' values
    (absent keys: None)."""

    def test(recipe: dict[str, Any], family: ModelFamily) -> bool:
        return (
            recipe.get("model_family", DEFAULT) == family.name
            and family.runs(program)
            and all(recipe.get(name) == value for name, value in keys.items())
        )

    return test


def _hf_export(recipe: dict[str, Any], family: ModelFamily) -> bool:
    """conversion=hf_export: a whole file of any family with a Hugging Face export."""
    return "nemo_file" in recipe and family.hf_architecture is not None


def tuning_reader(stage: str) -> Reader:
    """A tuning stage's: a reward-model stage starts from a reward model as well."""
    scores = TUNING_STAGE_SPECS[stage].task == "reward_model"
    return Reader(stage, "tunes", _of_family(stage), scores)


def evaluation_reader(kind: str, peft_method: str | None) -> Reader:
    """An evaluation recipe's (evaluation_kind, peft_method): the file it evaluates is taken
    by the recipes of the same kind and method."""
    return Reader(
        "evaluation",
        "evaluates",
        _of_family(f"evaluation:{kind}", evaluation_kind=kind, peft_method=peft_method),
    )


EXPORT_READER = Reader("export", "exports", _of_family("export"))
RESTORE_READER = Reader("training", "continues pretraining of", _of_family("training:restore"))
HF_EXPORT_READER = Reader("conversion", "exports", _hf_export, scores=True)
# Where a whole model's file of a family can go, in the order a fix names them.
WHOLE_FILE_READERS = (
    tuning_reader("fine_tuning"),
    tuning_reader("peft"),
    evaluation_reader("harness", None),
    evaluation_reader("fine_tuned", None),
    EXPORT_READER,
    RESTORE_READER,
    HF_EXPORT_READER,
)


@cache
def _recipes(group: str) -> tuple[tuple[str, dict[str, Any]], ...]:
    """A group's shipped recipes and their top-level keys (interpolations left unread)."""
    # Only a refusal asks: the job programs that import this module do not load Hydra.
    from launcher_scripts.config.compose import conf_dir, recipe_options

    found = []
    for name in recipe_options(group):
        loaded = yaml.safe_load((conf_dir() / group / f"{name}.yaml").read_text())
        found.append((name, loaded if isinstance(loaded, dict) else {}))
    return tuple(found)


def recipes_taking(family: ModelFamily, reader: Reader) -> list[str]:
    """`<group>=<recipe>` of the shipped recipes that take a file of `family` the reader's
    way; those of the family's own folders first, in the order of its model_types (a T5
    file's t5/ recipes before mt5/'s)."""

    def order(name: str) -> tuple[int, str]:
        folder = name.split("/", 1)[0]
        types = family.model_types
        return (types.index(folder) if folder in types else len(types), name)

    names = [name for name, recipe in _recipes(reader.group) if reader.takes(recipe, family)]
    return [f"{reader.group}={name}" for name in sorted(names, key=order)]


def held_family(model: Any) -> str:
    """The family a portable file's model section names."""
    return str(model.get("model_family") or DEFAULT)


def architecture(model: Any, family: ModelFamily) -> str:
    """How messages name a model's architecture: the Hugging Face class that holds it (an
    imported model's own), else the family's first model type."""
    recorded = model.get("hf_architecture")
    if recorded:
        return str(recorded)
    if family.hf_architecture is not None:
        try:
            return family.hf_architecture(model, key_prefix="model").name
        except (ConfigError, KeyError, TypeError, ValueError, AttributeError):
            pass  # a layout no transformers class holds: named by its family below
    return f"{family.model_types[0]} layout"


def described(model: Any) -> str:
    """'a t5 model (T5ForConditionalGeneration)', for a portable file's model section."""
    name = held_family(model)
    family = FAMILIES.get(name)
    if family is None:
        return f"a model of family {name!r}, which this version does not know"
    return f"a {name} model ({architecture(model, family)})"


def _fix(held: str, wanted: ModelFamily, reader: Reader) -> str:
    give = f"Give a {wanted.name} model's file"
    family = FAMILIES.get(held)
    if family is None:
        return give
    same_way = recipes_taking(family, reader)
    if same_way:
        return f"{give}, or take this one with {same_way[0]}"
    elsewhere = [found[0] for r in WHOLE_FILE_READERS if (found := recipes_taking(family, r))]
    elsewhere = list(dict.fromkeys(elsewhere))
    if not elsewhere:
        return f"{give}: this version has no recipe that takes a {held} model's file this way"
    return f"{give}; this version takes a {held} model's file in {', '.join(elsewhere)}"


def family_problem(
    model: Any, wanted: ModelFamily, source: str | Path, reader: Reader
) -> tuple[str, str] | None:
    """(problem, fix) when a portable file's model section (`source`: the file, for messages)
    is not of the family a recipe reads; None when it is."""
    held = held_family(model)
    if REWARD_MODEL in model and not reader.scores:
        return (
            f"{source} is a reward model (a scalar head, no output layer), and this recipe "
            f"{reader.verb} language models",
            "Give a language model's .nemo file; serve a reward model with `python3 -m "
            "launcher_scripts serve-reward`, or export it with conversion=hf_export",
        )
    if held == wanted.name:
        return None
    return (
        f"{source} holds {described(model)}, and this recipe {reader.verb} {wanted.name} ones",
        _fix(held, wanted, reader),
    )


def require_family(
    model: Any, wanted: ModelFamily, key: str, source: str | Path, reader: Reader
) -> None:
    """family_problem for a preflight: ConfigError naming `key`."""
    problem = family_problem(model, wanted, source, reader)
    if problem is not None:
        raise ConfigError(key, *problem)


# ----- PEFT files: the base they were tuned on --------------------------------------------


def peft_record(base_model: Any, base_file: str | Path) -> dict[str, str]:
    """What a PEFT file records of the base it was tuned on (the tuning job writes it)."""
    name = held_family(base_model)
    family = FAMILIES.get(name)
    return {
        "base_model": str(base_file),
        "model_family": name,
        "base_architecture": architecture(base_model, family) if family else name,
    }


def peft_base(peft_config: Any) -> tuple[str, str] | None:
    """(family, architecture) of the base a PEFT file was tuned on; from its recorded base
    file for a file that records only that, when the file is still there; else None."""
    name = peft_config.get("model_family")
    if name:
        return str(name), str(peft_config.get("base_architecture") or name)
    base = peft_config.get("base_model")
    if not base:
        return None
    try:
        model = inspect_portable(str(base)).config
    except (PortableFileError, OSError):
        return None
    family = FAMILIES.get(held_family(model))
    return held_family(model), architecture(model, family) if family else held_family(model)


def pair_problem(
    peft_config: Any, peft_source: str | Path, base_model: Any, base_source: str | Path
) -> tuple[str, str] | None:
    """(problem, fix) when a PEFT file was tuned on a base of another family than the base
    file given with it; None when they agree (or the PEFT file does not say)."""
    tuned_on = peft_base(peft_config)
    if tuned_on is None or tuned_on[0] == held_family(base_model):
        return None
    family, arch = tuned_on
    recorded = peft_config.get("base_model")
    its_base = f" ({recorded})" if recorded else ""
    return (
        f"{peft_source} was tuned on a {family} model ({arch}), but the base {base_source} "
        f"holds {described(base_model)}",
        f"Give the {family} base it was tuned on{its_base}, or a PEFT file tuned on this base",
    )


def require_pair(
    peft_config: Any,
    key: str,
    peft_source: str | Path,
    base_model: Any,
    base_source: str | Path,
) -> None:
    """pair_problem for a preflight: ConfigError naming the PEFT file's `key`."""
    problem = pair_problem(peft_config, peft_source, base_model, base_source)
    if problem is not None:
        raise ConfigError(key, *problem)


def require_peft_family(
    peft_config: Any, wanted: ModelFamily, key: str, source: str | Path, reader: Reader
) -> None:
    """A PEFT file whose base file is not there yet (an earlier stage writes it): tuned on a
    model of the recipe's family."""
    tuned_on = peft_base(peft_config)
    if tuned_on is None or tuned_on[0] == wanted.name:
        return
    family, arch = tuned_on
    raise ConfigError(
        key,
        f"{source} was tuned on a {family} model ({arch}), and this recipe {reader.verb} "
        f"{wanted.name} ones",
        _fix(family, wanted, reader),
    )


# The model-section keys two files must share to be one architecture (a DPO policy and its
# reference).
SHAPE_KEYS = (
    "model_family",
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "position_embedding_type",
    "normalization",
    "activation",
)


def twin_problem(model: Any, path: Path, other: Any, other_path: Path) -> str | None:
    """Why two portable files are not the same architecture with the same tokenizer (what
    comparing one's log-probabilities with the other's needs); None when they are."""
    from launcher_scripts.formats.portable import tokenizer_digest

    for key in SHAPE_KEYS:
        if model.get(key) != other.get(key):
            return (
                f"{other_path} has {key} {other.get(key)!r} and {path} {model.get(key)!r}: "
                "give a reference of the policy's architecture"
            )
    if tokenizer_digest(path) != tokenizer_digest(other_path):
        return (
            f"{other_path} and {path} hold different tokenizers: give a reference that shares "
            "the policy's"
        )
    return None
