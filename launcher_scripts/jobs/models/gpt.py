"""GPT's torch side: megatron-core's GPTModel over GPTDataset's next-token samples."""

from __future__ import annotations

from functools import partial
from typing import Any

from launcher_scripts.jobs.models import gpt_hf
from launcher_scripts.jobs.models.base import ModelRuntime, token_loss
from launcher_scripts.jobs.training import data, model


def forward_step(batch: dict[str, Any], chunk: Any) -> tuple[Any, Any]:
    mask = batch.get("attention_mask")  # None: causal over the whole sequence
    output = chunk(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"])
    return output, partial(token_loss, batch["loss_mask"])


RUNTIME = ModelRuntime(
    transformer_config=model.transformer_config,
    build_chunks=model.build_chunks,
    data_tokenizer=data.vocab_info,
    build_datasets=data.build_datasets,
    forward_step=forward_step,
    sequence_lengths=lambda cfg: (int(cfg.model.data.seq_length), None),
    batch_keys=data.BATCH_KEYS,
    to_hf=gpt_hf.to_hf,
)
