"""A model built from a portable checkpoint at this process group's TP/PP, for evaluation and
serving. The caller has initialised torch.distributed and megatron-core's parallel state."""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from launcher_scripts.families import family_of
from launcher_scripts.formats.portable import EMBEDDINGS, REWARD_MODEL, Portable
from launcher_scripts.jobs.models.base import runtime_of
from launcher_scripts.jobs.models.reward_head import with_reward_head
from launcher_scripts.jobs.training.init_weights import load_full_tensors


def inference_cfg(model: DictConfig, tensor: int, pipeline: int, expert: int = 1) -> DictConfig:
    """The training-shaped config the model builder reads, for an inference layout (with
    `expert` > 1, as many data-parallel ranks, over which the experts are split)."""
    section = OmegaConf.to_container(model, resolve=True)
    assert isinstance(section, dict)
    section |= {
        "tensor_model_parallel_size": tensor,
        "pipeline_model_parallel_size": pipeline,
        "virtual_pipeline_model_parallel_size": None,
        "context_parallel_size": 1,
        "expert_model_parallel_size": expert,
        "expert_tensor_parallel_size": None,
        "sequence_parallel": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "activations_checkpoint_granularity": None,
        # The embedding rows are already padded: take them as they are.
        "make_vocab_size_divisible_by": 1,
    }
    if "pipeline_model_parallel_split_rank" in section:
        # An encoder-decoder runs its decoder on the last stage (recipes.training).
        section["pipeline_model_parallel_split_rank"] = max(pipeline - 1, 0)
    devices = tensor * pipeline * expert
    trainer = {"precision": section.pop("precision", 32), "devices": devices}
    return OmegaConf.create({"model": section, "trainer": trainer | {"num_nodes": 1}})


def build(
    portable: Portable,
    tensor: int,
    pipeline: int,
    on_gpu: bool,
    precision: Any = None,
    expert: int = 1,
) -> list[Any]:
    """The file's model in this layout, in eval mode; at `precision` (a trainer.precision
    value) instead of the file's when given."""
    cfg = inference_cfg(portable.config, tensor, pipeline, expert)
    if precision is not None:
        cfg.trainer.precision = precision
    rows = portable.tensors.shape(EMBEDDINGS)[0]
    if rows % tensor:
        raise ValueError(f"the {rows} embedding rows do not split over TP={tensor}")
    runtime = runtime_of(family_of(portable.config, "model"))
    config = runtime.transformer_config(cfg, False, on_gpu)
    chunks = runtime.build_chunks(cfg, config, rows, False)
    if REWARD_MODEL in portable.config:  # its head in place of the output layer
        with_reward_head(chunks, config)
    if on_gpu:
        chunks = [chunk.cuda(torch.cuda.current_device()) for chunk in chunks]
    load_full_tensors(chunks, portable.tensors)
    for chunk in chunks:
        chunk.eval()
    return chunks
