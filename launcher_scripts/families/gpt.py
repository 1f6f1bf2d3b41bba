"""GPT: a decoder-only language model (megatron-core's GPTModel), the family every stage runs."""

from __future__ import annotations

from launcher_scripts.costmodel.plan import decoder_stack_costs
from launcher_scripts.families.base import PROGRAMS, ModelFamily, register
from launcher_scripts.families.gpt_architectures import hf_architecture
from launcher_scripts.recipes import training as recipe

GPT = register(
    ModelFamily(
        name="gpt",
        model_types=("gpt3",),
        validate=recipe.validate,
        costs=decoder_stack_costs,
        encoder_decoder=False,
        pile_tokenizers=("GPT2BPETokenizer",),
        programs=frozenset(PROGRAMS),
        hf_architecture=hf_architecture,
        runtime="launcher_scripts.jobs.models.gpt",
    )
)
