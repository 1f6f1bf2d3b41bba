"""BERT: an encoder trained on masked tokens and sentence order (megatron-core's BertModel).
Its recipes keep GPT's flat model keys plus the masked-LM settings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from launcher_scripts.config.checks import require_choice, require_position_embedding
from launcher_scripts.costmodel.plan import decoder_stack_costs, stack_shape
from launcher_scripts.errors import ConfigError
from launcher_scripts.families.base import (
    Architecture,
    ModelFamily,
    head_size_problem,
    register,
)
from launcher_scripts.families.encoder_checks import (
    ENCODER_ACTIVATIONS,
    common_checks,
)
from launcher_scripts.recipes import training as recipe
from launcher_scripts.recipes.layout import check_world, read_layout
from launcher_scripts.recipes.training import key

# BERT's, as megatron-core's BertModel takes them.
BERT_POSITION_EMBEDDINGS = ("learned_absolute", "rope")

# pre_ln: megatron-core's BERT (the NeMo launcher's); post_ln: the original BERT (Hugging Face's).
BLOCK_TYPES = ("pre_ln", "post_ln")
DATALOADERS = ("single", "cyclic")


def validate(cfg: Any, stage: str, will_exist: Callable[[str], bool]) -> None:
    model = cfg.model
    layout = read_layout(cfg, stage)
    check_world(layout, stage)
    recipe.check_layer_split(
        model.num_layers, layout.pipeline * (layout.virtual_pipeline or 1), layout, stage
    )
    recipe.check_attention(model, layout, key(stage, "model"))
    seq = recipe.check_sequence(model.data.seq_length, layout, stage)
    recipe.check_positions(model, seq, "model.data.seq_length", stage)
    require_choice(
        key(stage, "model.activation"), model.get("activation", "gelu"), ENCODER_ACTIVATIONS
    )
    require_position_embedding(
        key(stage, "model.position_embedding_type"),
        model.get("position_embedding_type", "learned_absolute"),
        BERT_POSITION_EMBEDDINGS,
    )
    require_choice(
        key(stage, "model.transformer_block_type"),
        model.get("transformer_block_type", "pre_ln"),
        BLOCK_TYPES,
    )
    if not isinstance(model.get("bert_binary_head", True), bool):
        raise ConfigError(key(stage, "model.bert_binary_head"), "is not true or false", "Fix it")
    loader = model.data.get("dataloader_type", "single")
    if str(loader).upper() == "LDDL":
        raise ConfigError(
            key(stage, "model.data.dataloader_type"),
            "LDDL is not supported by this launcher (its binned, pre-masked Parquet shards)",
            "Use single: data_preparation's sentence-split shards, masked as they are read",
        )
    require_choice(key(stage, "model.data.dataloader_type"), loader, DATALOADERS)
    recipe.check_recompute(model, stage)
    common_checks(cfg, stage, will_exist)


# transformer_block_type -> the class with the sentence-order head, and the one without
HF_ARCHITECTURES = {
    "post_ln": (
        Architecture("BertForPreTraining", "bert"),
        Architecture("BertForMaskedLM", "bert"),
    ),
    "pre_ln": (
        Architecture("MegatronBertForPreTraining", "megatron-bert"),
        Architecture("MegatronBertForMaskedLM", "megatron-bert"),
    ),
}


def hf_architecture(model: Any, key_prefix: str = "model") -> Architecture:
    """post_ln: Hugging Face's BERT; pre_ln (megatron-core's layout, a final LayerNorm, none on
    the embeddings): its MegatronBert. Both take learned positions, LayerNorm and the exact
    GeLU in every layer, which is what they compute."""

    def refuse(name: str, problem: str) -> ConfigError:
        return ConfigError(
            f"{key_prefix}.{name}",
            f"{problem}: no Hugging Face BERT class computes this model",
            "Export a BERT with learned_absolute positions, gelu and layernorm, or set "
            "conversion.run.hf_dir_name=null",
        )

    for name, default, allowed in (
        ("position_embedding_type", "learned_absolute", "learned_absolute"),
        ("activation", "gelu", "gelu"),
        ("normalization", "layernorm", "layernorm"),
    ):
        value = model.get(name, default)
        if value != allowed:
            raise refuse(name, f"{value!r}")
    heads = int(model.num_attention_heads)
    if int(model.get("num_query_groups") or heads) != heads:
        raise refuse("num_query_groups", "grouped-query attention")
    head_size = head_size_problem(model)
    if head_size:
        raise refuse("kv_channels", head_size)
    with_head, without = HF_ARCHITECTURES[str(model.get("transformer_block_type", "pre_ln"))]
    return with_head if model.get("bert_binary_head", True) else without


BERT = register(
    ModelFamily(
        name="bert",
        model_types=("bert",),
        validate=validate,
        shape=stack_shape,
        costs=decoder_stack_costs,  # the same layer stack; its small pooler and heads left out
        encoder_decoder=False,
        pile_tokenizers=("BertWordPieceLowerCase", "BertWordPieceCase"),
        programs=frozenset({"training", "conversion"}),
        hf_architecture=hf_architecture,
        sentence_data=True,
        runtime="launcher_scripts.jobs.models.bert",
    )
)
