"""LoRA: a low-rank update B A added to chosen linears of every chosen layer; folds into the
base weights (merge-lora, the Hugging Face export)."""

from __future__ import annotations

from typing import Any

from launcher_scripts.config.checks import require_int
from launcher_scripts.errors import RecipeError
from launcher_scripts.tuning.method import PeftMethod, PeftSettings, layers, plain, register

NAME = "lora"
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


def _named_targets(section: Any) -> list[str] | None:
    """The targets a section names; None for `all` (every one the model has)."""
    targets = plain(section.get("target_modules")) or ["attention_qkv"]
    return None if targets in ("all", ["all"]) else [str(t) for t in targets]


def read(section: Any, key: str) -> PeftSettings:
    named = _named_targets(section)
    rank = require_int(f"{key}.adapter_dim", section.get("adapter_dim", 32))
    return PeftSettings(
        scheme=NAME,
        rank=rank,
        alpha=float(section.get("alpha") or rank),
        dropout=float(section.get("adapter_dropout") or 0.0),
        target_modules=tuple(LORA_TARGET_NAMES if named is None else named),
        column_init=str(section.get("column_init_method") or "xavier"),
        row_init=str(section.get("row_init_method") or "zero"),
        layer_selection=layers(section),
    )


def check(settings: PeftSettings, key: str) -> None:
    unknown = [t for t in settings.target_modules if t not in LORA_TARGET_NAMES]
    if unknown or not settings.target_modules:
        raise RecipeError(
            f"{key}.target_modules: {list(settings.target_modules)}: choose from "
            f"{', '.join(LORA_TARGET_NAMES)} (or all)"
        )
    if settings.rank < 1:
        raise RecipeError(f"{key}.adapter_dim must be at least 1, not {settings.rank}")


def check_model(
    settings: PeftSettings, section: Any, base: Any, encoder_decoder: bool, key: str
) -> None:
    """A target the base model has no linear for: cross-attention's without cross-attention,
    a dense MLP's when every layer's MLP is experts (`all` takes the targets the model has)."""
    del settings
    named = set(_named_targets(section) or ())
    mlp = sorted(named & {"mlp_fc1", "mlp_fc2"})
    if mlp and base.get("num_moe_experts") and base.get("moe_layer_freq", 1) == 1:
        raise RecipeError(
            f"{key}.target_modules: {mlp} adapt a dense MLP, and every layer of this model "
            f"routes to experts instead ({base.num_moe_experts}, num_moe_experts): adapt "
            "attention_qkv and attention_dense (this version puts no LoRA on experts)"
        )
    named &= set(CROSS_ATTENTION_TARGETS)
    if named and not encoder_decoder:
        raise RecipeError(
            f"{key}.target_modules: {sorted(named)} adapt a decoder's cross-attention, which "
            "this model has none of: use attention_qkv, attention_dense, mlp_fc1, mlp_fc2"
        )


register(
    PeftMethod(
        name=NAME,
        title="LoRA",
        section="lora_tuning",
        read=read,
        check=check,
        prefixes=("lora_",),
        runtime="launcher_scripts.jobs.fine_tuning.methods.lora",
        merges=True,
        check_model=check_model,
    )
)
