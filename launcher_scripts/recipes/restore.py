"""Continued pretraining: a training recipe that starts from a portable file's weights
(`model.restore_from_path`: what conversion=hf_import, the conversion stage or fine-tuning
wrote) instead of random ones.

The file decides the model: its architecture, its tokenizer and its embedding rows. The recipe
gives the layout, batches, data, optimizer and schedule, as for any training run, and may state
the architecture too (the shipped recipes do, so that a dry run plans the right model before the
file exists): every architecture key the recipe states must then be what the file holds, else
one line names the key. The preflight checks this when the file is there; the job checks it
again at start-up (an earlier stage of the same run may write the file).

Torch-free: the launcher's preflight and the job both use it.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher_scripts.config.checks import require_row_split
from launcher_scripts.errors import ConfigError
from launcher_scripts.formats.portable import HF_VOCAB_SIZE

RESTORE_KEY = "model.restore_from_path"

# The keys a portable file's model_config.yaml decides, with the value the GPT runtime takes
# when a section leaves one out (jobs/models/transformer.py and gpt.py).
ARCHITECTURE_DEFAULTS: dict[str, Any] = {
    "num_layers": None,
    "hidden_size": None,
    "ffn_hidden_size": None,
    "num_attention_heads": None,
    "num_query_groups": None,
    "kv_channels": None,
    "max_position_embeddings": None,
    "position_embedding_type": "learned_absolute",
    "rotary_percentage": 1.0,
    "rotary_base": 10000.0,
    "rope_scaling_factor": None,
    "normalization": "layernorm",
    "layernorm_epsilon": 1e-5,
    "activation": "gelu",
    "bias": True,
    "qkv_bias": False,
    "qk_layernorm": False,
    "share_embeddings_and_output_weights": True,
    # the experts (recipes/model_shape.py's EXPERT_ARCHITECTURE_KEYS)
    "num_moe_experts": None,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": None,
    "moe_shared_expert_intermediate_size": None,
    "moe_shared_expert_gate": False,
    "moe_layer_freq": 1,
    "moe_router_pre_softmax": False,
}


def restore_path(model: Any) -> str | None:
    value = model.get("restore_from_path")
    return str(value) if value else None


def _value(section: Any, name: str) -> Any:
    """The architecture value a section means, with the runtime's defaults filled in."""
    value = section.get(name, ARCHITECTURE_DEFAULTS[name])
    if value is None and name == "num_query_groups":
        value = section.get("num_attention_heads")
    if value is None and name == "kv_channels":
        value = int(section.get("hidden_size")) // int(section.get("num_attention_heads"))
    if value is None and name == "ffn_hidden_size":
        value = 4 * int(section.get("hidden_size"))
    if value is None and name == "moe_ffn_hidden_size" and section.get("num_moe_experts"):
        value = _value(section, "ffn_hidden_size")
    if name == "moe_layer_freq" and not isinstance(value, int | str):
        value = [int(v) for v in value]
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)  # 500000 and 500000.0 are one rope base
    return value


def check_architecture(recipe_model: Any, file_model: Any, stage: str, where: str) -> None:
    """ConfigError naming the first architecture key the recipe states differently from the
    file (`where`: how to name the file in the message)."""
    for name in ARCHITECTURE_DEFAULTS:
        if name not in recipe_model:
            continue  # the file's, whatever it is
        wanted, held = _value(recipe_model, name), _value(file_model, name)
        if wanted != held:
            shown = file_model.get(name, held)
            raise ConfigError(
                f"{stage}.model.{name}",
                f"is {recipe_model.get(name)!r}, but {where} holds a model with {shown!r}",
                f"Set {stage}.model.{name}={shown} (or leave it out: the file's architecture is "
                "used), or give the file of the model this recipe describes",
            )


def check_rows(recipe_model: Any, rows: int, stage: str, where: str) -> None:
    """The file's embedding rows against the recipe's padded_vocab_size (what the plan counts
    before the file exists) and its tensor-parallel split."""
    stated = recipe_model.get("padded_vocab_size")
    if stated is not None and int(stated) != rows:
        raise ConfigError(
            f"{stage}.model.padded_vocab_size",
            f"is {stated}, but {where} has {rows} embedding rows",
            f"Set it to {rows}, or leave it out",
        )
    tensor = int(recipe_model.get("tensor_model_parallel_size") or 1)
    require_row_split(rows, tensor, f"{stage}.model", f"{where}'s")


def restored_model(recipe_model: Any, file_model: Any, rows: int, stage: str) -> DictConfig:
    """The model section a continued pretraining job builds: the recipe's with the file's
    architecture and tokenizer, and its embedding rows as they are (already padded)."""
    where = f"{stage}.{RESTORE_KEY}"
    check_architecture(recipe_model, file_model, stage, where)
    check_rows(recipe_model, rows, stage, where)
    section = OmegaConf.to_container(recipe_model, resolve=True)
    assert isinstance(section, dict)
    for name in ARCHITECTURE_DEFAULTS:
        if name in file_model:
            section[name] = OmegaConf.to_container(file_model, resolve=True)[name]
    section["tokenizer"] = OmegaConf.to_container(file_model.tokenizer, resolve=True)
    section["make_vocab_size_divisible_by"] = 1
    section["padded_vocab_size"] = rows
    if file_model.get(HF_VOCAB_SIZE) is not None:
        # An imported model's rows before the import's padding: its export drops the rest.
        section[HF_VOCAB_SIZE] = int(file_model[HF_VOCAB_SIZE])
    return OmegaConf.create(section)
