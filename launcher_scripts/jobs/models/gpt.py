"""GPT's torch side: megatron-core's GPTModel over GPTDataset's next-token samples."""

from __future__ import annotations

from functools import partial
from typing import Any

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_decoder_layer_specs,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from launcher_scripts.jobs.fine_tuning import peft, sft_data
from launcher_scripts.jobs.fine_tuning.answers import prompt_logits
from launcher_scripts.jobs.inference.generation import Prefixed
from launcher_scripts.jobs.inference.runner import ModelRunner, OpenedModel, runner_of
from launcher_scripts.jobs.inference.served import ServedModel
from launcher_scripts.jobs.inference.text_tokenizer import load_text_tokenizer
from launcher_scripts.jobs.models import gpt_hf
from launcher_scripts.jobs.models.base import ModelRuntime, TuningSide, token_loss
from launcher_scripts.jobs.models.transformer import (
    LocalNorm,
    padded_vocab_size,
    transformer_config,
    use_local_experts,
)
from launcher_scripts.jobs.training import data


def layer_spec(
    config: TransformerConfig, use_te: bool, vp_stage: int | None
) -> ModuleSpec | TransformerBlockSubmodules:
    """The layers of this pipeline stage (and virtual stage): megatron-core's MoE layers where
    the model has experts (moe_layer_freq), dense ones elsewhere."""
    if config.num_moe_experts:
        if use_te:
            return get_gpt_decoder_block_spec(config, True, config.normalization, vp_stage=vp_stage)
        specs = get_gpt_decoder_layer_specs(config, False, config.normalization)
        for spec in {id(spec): spec for spec in specs}.values():
            spec.submodules.input_layernorm = LocalNorm
            spec.submodules.pre_mlp_layernorm = LocalNorm
            if spec.submodules.mlp.module is MoELayer:
                use_local_experts(spec)
        first = get_transformer_layer_offset(config, vp_stage=vp_stage)
        mine = specs[first : first + get_num_layers_to_build(config, vp_stage=vp_stage)]
        return TransformerBlockSubmodules(layer_specs=mine, layer_norm=LocalNorm)
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=None, qk_layernorm=config.qk_layernorm, fp8=None
        )
    spec = get_gpt_layer_local_spec(
        normalization=config.normalization, qk_layernorm=config.qk_layernorm
    )
    spec.submodules.input_layernorm = LocalNorm
    spec.submodules.pre_mlp_layernorm = LocalNorm
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=LocalNorm)


def build_chunks(
    cfg: Any, config: TransformerConfig, vocab_size: int, use_te: bool
) -> list[GPTModel]:
    """This rank's model chunks: one, or one per virtual pipeline stage."""
    model = cfg.model
    vp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vp or 1):
        stage = vp_stage if vp else None
        spec = layer_spec(config, use_te, stage)
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=spec,
                vocab_size=padded_vocab_size(vocab_size, cfg),
                max_sequence_length=model.max_position_embeddings,
                pre_process=parallel_state.is_pipeline_first_stage(
                    ignore_virtual=False, vp_stage=stage
                ),
                post_process=parallel_state.is_pipeline_last_stage(
                    ignore_virtual=False, vp_stage=stage
                ),
                fp16_lm_cross_entropy=bool(model.get("fp16_lm_cross_entropy", False)),
                parallel_output=True,
                share_embeddings_and_output_weights=bool(
                    model.get("share_embeddings_and_output_weights", True)
                ),
                position_embedding_type=model.position_embedding_type,
                rotary_percent=float(model.get("rotary_percentage", 1.0)),
                rotary_base=float(model.get("rotary_base", 10000)),
                # Llama 3's scaling of the low frequencies (megatron-core's, by its factor)
                rope_scaling=model.get("rope_scaling_factor") is not None,
                rope_scaling_factor=float(model.get("rope_scaling_factor") or 8.0),
                vp_stage=stage,
            )
        )
    return chunks


def forward_step(batch: dict[str, Any], chunk: Any) -> tuple[Any, Any]:
    mask = batch.get("attention_mask")  # None: causal over the whole sequence
    output = chunk(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"])
    return output, partial(token_loss, batch["loss_mask"])


def sample_maker(cfg: Any, tokenizer: Any) -> sft_data.SampleMaker:
    return partial(sft_data.padded_sample, int(cfg.model.data.seq_length), tokenizer.eod_id)


def generation(
    cfg: Any, chunks: list[Any], tokenizer: Any, par: Any, on_gpu: bool, prefix: list[int]
) -> tuple[Any, Any, int]:
    """Next-token logits of the prompt continued in place, behind the prefix."""
    runner = ModelRunner(
        chunks=chunks,
        tokenizer=tokenizer,
        max_length=int(cfg.model.max_position_embeddings),
        vocab_size=tokenizer.vocab_size,
        tensor=par.tensor,
        pipeline=par.pipeline,
        on_gpu=on_gpu,
    )
    if par.sequence_parallel:
        # A training model's blocks split the sequence over the TP ranks, which a KV cache's
        # one new token a step cannot be: whole rows, padded to a multiple of TP, each step.
        decoding = prompt_logits(runner, prefix, par.tensor)
    else:
        decoding = Prefixed(runner, prefix)
    return decoding, tokenizer, runner.max_length - len(prefix)


def served(opened: OpenedModel) -> ServedModel:
    """The prompt continued in place: prompt and answer share the model's positions."""
    runner = runner_of(opened)

    def too_long(prompt_tokens: int, tokens_to_generate: int) -> str | None:
        if prompt_tokens + tokens_to_generate <= runner.max_length:
            return None
        return (
            f"the prompt is {prompt_tokens} tokens and tokens_to_generate is "
            f"{tokens_to_generate}: together more than the model's {runner.max_length} "
            "positions. Shorten the prompt or lower tokens_to_generate"
        )

    return ServedModel(
        decoding=runner,
        tokenizer=runner.tokenizer,
        max_length=runner.max_length,
        shape=runner.forward_shape(),
        on_gpu=opened.on_gpu,
        too_long=too_long,
    )


TUNING = TuningSide(
    text_tokenizer=lambda model_section: load_text_tokenizer(model_section.tokenizer),
    encode=sft_data.encode_record,
    sample_maker=sample_maker,
    generation=generation,
    chat=True,
    peft_sites=peft.DECODER_STACK,
)

RUNTIME = ModelRuntime(
    transformer_config=transformer_config,
    build_chunks=build_chunks,
    data_tokenizer=data.vocab_info,
    build_datasets=data.build_datasets,
    forward_step=forward_step,
    sequence_lengths=lambda cfg: (int(cfg.model.data.seq_length), None),
    batch_keys=data.BATCH_KEYS,
    to_hf=gpt_hf.to_hf,
    tuning=TUNING,
    served=served,
)
