"""GPT's torch side: megatron-core's GPTModel over GPTDataset's next-token samples."""

from __future__ import annotations

from functools import partial
from typing import Any

from launcher_scripts.jobs.fine_tuning import peft, sft_data
from launcher_scripts.jobs.fine_tuning.answers import prompt_logits
from launcher_scripts.jobs.inference.runner import ModelRunner, OpenedModel, runner_of
from launcher_scripts.jobs.inference.served import ServedModel
from launcher_scripts.jobs.inference.text_tokenizer import load_text_tokenizer
from launcher_scripts.jobs.models import gpt_hf
from launcher_scripts.jobs.models.base import ModelRuntime, TuningSide, token_loss
from launcher_scripts.jobs.training import data, model


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
    logits = prompt_logits(runner, prefix, par.tensor if par.sequence_parallel else 1)
    return logits, tokenizer, runner.max_length - len(prefix)


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
        logits=runner.logits,
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
    transformer_config=model.transformer_config,
    build_chunks=model.build_chunks,
    data_tokenizer=data.vocab_info,
    build_datasets=data.build_datasets,
    forward_step=forward_step,
    sequence_lengths=lambda cfg: (int(cfg.model.data.seq_length), None),
    batch_keys=data.BATCH_KEYS,
    to_hf=gpt_hf.to_hf,
    tuning=TUNING,
    served=served,
)
