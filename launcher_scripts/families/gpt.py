"""GPT: a decoder-only language model (megatron-core's GPTModel), the family every stage runs."""

from __future__ import annotations

from typing import Any

from launcher_scripts.costmodel.plan import decoder_stack_costs, stack_shape
from launcher_scripts.errors import ConfigError
from launcher_scripts.families.base import ModelFamily, register
from launcher_scripts.families.gpt_architectures import ARCHITECTURES, hf_architecture
from launcher_scripts.families.gpt_hf_config import check_checkpoint, model_section
from launcher_scripts.formats.portable_check import GATED_ACTIVATIONS, expected_shapes
from launcher_scripts.recipes import training as recipe
from launcher_scripts.recipes.model_shape import read_experts
from launcher_scripts.recipes.tuning import TUNING_STAGES


def portable_shapes(config: Any) -> dict[str, tuple[tuple[int | None, ...], str]]:
    """What a GPT file's model_config.yaml says its tensors' shapes are: the dense stack's
    (formats.portable_check), and a mixture of experts' router and experts, stacked over the
    layers, or layer by layer where only some layers have experts (megatron-core keeps a stack
    of unlike layers so)."""
    table = expected_shapes(config)
    ffn = int(config.get("ffn_hidden_size") or 4 * int(config["hidden_size"]))
    layers = int(config["num_layers"])
    experts = read_experts(config, "model", layers, ffn)
    if experts is None:
        return table
    hidden, count = int(config["hidden_size"]), experts.count
    fc1 = experts.ffn_hidden_size * (2 if str(config.get("activation")) in GATED_ACTIVATIONS else 1)
    keys = "num_moe_experts, moe_ffn_hidden_size, activation, hidden_size"
    per_layer = {
        "mlp.router.weight": ((count, hidden), "num_moe_experts, hidden_size"),
        "mlp.experts.experts.linear_fc1.weight": ((count, fc1, hidden), keys),
        "mlp.experts.experts.linear_fc2.weight": ((count, hidden, experts.ffn_hidden_size), keys),
    }
    if experts.layer_freq == 1:
        return table | {
            f"decoder.layers.{name}": ((layers, *shape), f"num_layers, {why}")
            for name, (shape, why) in per_layer.items()
        }
    moe = [i for i in range(layers) if experts.is_moe_layer(i)]
    why = "moe_layer_freq, "
    return table | {
        f"decoder.layers.{i}.{name}": (shape, why + keys_of)
        for i in moe
        for name, (shape, keys_of) in per_layer.items()
    }


def check_base(base: Any, model: Any, layout: Any, stage: str, name: str) -> None:
    """The tuning layout splits the base's heads over TP and its layers over PP."""
    del model
    recipe.check_attention(base, layout, name)
    layers = int(base.num_layers)
    if layers % layout.pipeline:
        raise ConfigError(
            f"{stage}.model.pipeline_model_parallel_size",
            f"the base model's {layers} layers do not split over {layout.pipeline} pipeline stages",
            "Choose a divisor",
        )


GPT = register(
    ModelFamily(
        name="gpt",
        model_types=("gpt3",),
        validate=recipe.validate,
        shape=stack_shape,
        costs=decoder_stack_costs,
        encoder_decoder=False,
        pile_tokenizers=("GPT2BPETokenizer",),
        programs=frozenset(
            {
                "training",
                "training:restore",
                "conversion",
                *TUNING_STAGES,
                "evaluation:harness",
                "evaluation:fine_tuned",
                "export",
                "hf_import",
            }
        ),
        hf_architecture=hf_architecture,
        runtime="launcher_scripts.jobs.models.gpt",
        check_base=check_base,
        portable_shapes=portable_shapes,
        hf_model_types=tuple(architecture.model_type for architecture in ARCHITECTURES),
        hf_import_section=model_section,
        hf_import_check=check_checkpoint,
        hf_importer="launcher_scripts.jobs.models.gpt_hf_import",
    )
)
