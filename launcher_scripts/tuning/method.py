"""What the rest of the launcher asks of a PEFT method, and the registry that answers.

A method is one module of this package (lora, adapter, ia3, prompt) that registers a
`PeftMethod`: how its settings are read from a recipe section and checked, which parameters
are its own, whether it folds into the base weights, and the module of its torch side (the
modules it adds to a megatron-core model, and its merge), which only job programs import.
Nothing outside this package compares a method's name: a new method is one module here, its
torch side under jobs/fine_tuning/methods/, and recipes. Torch-free: preflight reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from launcher_scripts.errors import RecipeError

INIT_METHODS = ("xavier", "normal", "zero")


@dataclass(frozen=True)
class PeftSettings:
    """One method's settings, with the defaults NeMo documents. One record for every method
    (each reads the fields it uses), as the PEFT file stores it."""

    scheme: str  # the method's name
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

    @property
    def method(self) -> PeftMethod:
        return method_named(self.scheme)

    def check(self, key: str) -> None:
        self.method.check(self, key)
        for name in (self.column_init, self.row_init):
            if name not in INIT_METHODS:
                raise RecipeError(f"{key}: init method {name!r} is not one of {INIT_METHODS}")

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


# (the method's recipe section, the key that names it) -> its settings
Reader = Callable[[Any, str], PeftSettings]
# (settings, the key to name in errors) -> None, or RecipeError naming what is wrong
Checker = Callable[[PeftSettings, str], None]
# (settings, the recipe's section, the base model's section, whether the model is an
# encoder-decoder, the section's key) -> None, or RecipeError: what the method asks of the
# base model
ModelCheck = Callable[[PeftSettings, Any, Any, bool, str], None]


@dataclass(frozen=True)
class PeftMethod:
    name: str  # the peft stage's `peft_scheme`, and the PEFT file's `scheme`
    title: str  # how messages name it ("LoRA")
    section: str  # the peft stage's section under model.peft that holds its settings
    read: Reader
    check: Checker
    # The attribute names its added modules take in the model (prefixes): the parameters
    # that learn, and the checkpoint entries that belong in a PEFT file.
    prefixes: tuple[str, ...]
    runtime: str  # the module of its torch side: attach(...), and merged(...) if it merges
    merges: bool = False  # folds into the base weights (merge-lora, the Hugging Face export)
    # The recipe keys of its section that the job reads with a default (the preflight's
    # key check knows them from here).
    optional_keys: tuple[str, ...] = ()
    # The older one-method stage that trains it (adapter_learning, ...), the section of that
    # stage's model holding its settings (None: defaults), and, where the stage chooses
    # between methods, the `virtual_prompt_style` that names this one.
    legacy_stage: str | None = None
    legacy_section: str | None = None
    legacy_style: str | None = None
    check_model: ModelCheck | None = None


METHODS: dict[str, PeftMethod] = {}


def register(method: PeftMethod) -> PeftMethod:
    if method.name in METHODS:
        raise ValueError(f"PEFT method {method.name!r} is registered twice")
    METHODS[method.name] = method
    return method


def method_named(name: str, key: str = "peft_scheme") -> PeftMethod:
    try:
        return METHODS[name]
    except KeyError:
        raise RecipeError(f"{key}: {name!r} is not one of {', '.join(METHODS)}") from None


def legacy_method(stage: str, style: str | None, style_key: str) -> PeftMethod:
    """The method an older one-method stage trains (prompt_learning: the one its
    `virtual_prompt_style` names)."""
    candidates = [m for m in METHODS.values() if m.legacy_stage == stage]
    if len(candidates) == 1:
        return candidates[0]
    styles = {m.legacy_style: m for m in candidates}
    if style not in styles:
        raise RecipeError(f"{style_key}: {style!r} trains nothing; use {' or '.join(styles)}")
    return styles[style]


def plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def layers(section: Any) -> tuple[int, ...] | None:
    """A section's `layer_selection` (1-based layer numbers), or None: every layer."""
    value = plain(section.get("layer_selection"))
    return None if value is None else tuple(int(v) for v in value)


def merging_titles() -> str:
    """The methods that fold into the base weights, for messages ("LoRA")."""
    return " or ".join(method.title for method in METHODS.values() if method.merges)
