"""GPT: a decoder-only language model (megatron-core's GPTModel), the family every stage runs."""

from __future__ import annotations

from typing import Any

from launcher_scripts.costmodel.plan import decoder_stack_costs, stack_shape
from launcher_scripts.errors import ConfigError
from launcher_scripts.families.base import ModelFamily, register
from launcher_scripts.families.gpt_architectures import ARCHITECTURES, hf_architecture
from launcher_scripts.families.gpt_hf_config import check_checkpoint, model_section
from launcher_scripts.formats.portable_check import expected_shapes
from launcher_scripts.recipes import training as recipe
from launcher_scripts.recipes.tuning import TUNING_STAGES


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
        portable_shapes=expected_shapes,
        hf_model_types=tuple(architecture.model_type for architecture in ARCHITECTURES),
        hf_import_section=model_section,
        hf_import_check=check_checkpoint,
        hf_importer="launcher_scripts.jobs.models.gpt_hf_import",
    )
)
