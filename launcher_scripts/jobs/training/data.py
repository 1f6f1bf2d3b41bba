"""Train and validation batches from the prepared `.bin/.idx` files, resumable by sample count.

megatron-core's BlendedMegatronDatasetBuilder and GPTDataset give a deterministic, shuffled
sequence of samples. A global batch is the next `global_batch_size` samples of that sequence;
each data-parallel rank takes its slice of every micro-batch, as Megatron's pretraining sampler
does. So the position in the data is one number, the consumed sample count: resuming from it
continues exactly, at any data-parallel size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset

from launcher_scripts.formats.indexed_writer import idx_path, read_index
from launcher_scripts.formats.shards import SPLIT_NAMES
from launcher_scripts.formats.tokenizer import load_tokenizer
from launcher_scripts.jobs.training.runtime import JobError
from launcher_scripts.recipes import training as recipe
from launcher_scripts.recipes import vocabulary


class DataError(JobError):
    pass


def check_splits(prefixes: tuple[str, ...], split: str, samples: tuple[int, int, int]) -> None:
    """Fail clearly where megatron-core would loop forever: samples asked of an empty split.

    GPTDataset splits each dataset by document count; a split that gets no documents (a small
    corpus with "99990,8,2") has no tokens to draw samples from.
    """
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    for prefix in prefixes:
        documents = IndexedDataset(prefix, mmap=True).sequence_lengths.shape[0]
        for name, wanted, bounds in zip(SPLIT_NAMES, samples, matrix, strict=True):
            if not wanted or bounds is None:
                continue
            begin, end = (int(round(b * float(documents))) for b in bounds)
            if end <= begin:
                raise DataError(
                    f"training.model.data.splits_string={split!r} leaves the {name} split of "
                    f"{prefix} ({documents} documents) empty: give it a larger share, e.g. "
                    '"90,5,5", or use a larger dataset'
                )


@dataclass(frozen=True)
class VocabInfo:
    """What the datasets and the model need of the tokenizer."""

    vocab_size: int
    eod: int

    @property
    def unique_identifiers(self) -> dict[str, int | str]:
        """Part of the key megatron-core caches dataset indices under."""
        return {"class": "VocabInfo", "vocab_size": self.vocab_size, "eod": self.eod}


def vocab_info(cfg: Any) -> VocabInfo:
    loaded = load_tokenizer(vocabulary.tokenizer_spec(cfg))
    return VocabInfo(loaded.vocab_size, loaded.eod_id)


def check_vocabulary(cfg: Any, vocab: VocabInfo, stage: str = "training") -> None:
    """The data holds no id the tokenizer lacks (preflight checked what existed then)."""
    spec = vocabulary.tokenizer_spec(cfg)
    vocabulary.check_token_ids(
        recipe.data_blend(cfg, stage).prefixes,
        vocab.vocab_size,
        str(spec.model or spec.vocab_file),
        vocabulary.tokenizer_key(cfg, stage),
        stage,
    )


def blend_weights(cfg: Any, blend: recipe.DataBlend) -> list[float] | None:
    """The blend's weights: data_prefix's, else, for paths alone and run.blending_alpha set
    (the mT5 recipes), each dataset's tokens ** alpha normalised (None: by size, as
    megatron-core weights unweighted paths)."""
    if blend.weights:
        return list(blend.weights)
    alpha = recipe.blending_alpha(cfg)
    if alpha is None or len(blend.prefixes) < 2:
        return None
    counts = [read_index(idx_path(prefix)).token_count for prefix in blend.prefixes]
    weights = recipe.sampling_weights(counts, alpha)
    if parallel_state.model_parallel_is_initialized() and torch.distributed.get_rank() == 0:
        shown = ", ".join(
            f"{Path(p).name} {w:.4f}" for p, w in zip(blend.prefixes, weights, strict=True)
        )
        print(f"blend weights (tokens ** {alpha}): {shown}", flush=True)
    return list(weights)


def build_splits(
    cfg: Any,
    dataset_type: type,
    config_type: type,
    tokenizer: Any,
    samples: tuple[int, int, int],
    cache_dir: Path,
    **fields: Any,
) -> tuple[Any, Any, Any]:
    """(train, validation, test) datasets of the recipe's blend sized for `samples`, of any
    megatron-core dataset class: the fields every config shares come from the recipe, the
    dataset's own ones are `fields`. Rank 0 builds the index first."""
    data = cfg.model.data
    blend = recipe.data_blend(cfg)
    split = str(data.get("splits_string", "969,30,1"))
    check_splits(blend.prefixes, split, samples)
    config = config_type(
        random_seed=int(cfg.model.get("seed", 1234)),
        sequence_length=int(data.seq_length),
        blend=(list(blend.prefixes), blend_weights(cfg, blend)),
        split=split,
        path_to_cache=str(cache_dir),
        tokenizer=tokenizer,
        mmap_bin_files=True,
        **fields,
    )
    if not samples[2]:
        # Skip the test split (same train/validation boundaries): pretraining never reads it,
        # and megatron-core cannot build a split that holds no documents.
        config.split_matrix = [*config.split_matrix[:2], None]
    builder = BlendedMegatronDatasetBuilder(dataset_type, list(samples), lambda: True, config)
    train, valid, test = builder.build()
    return train, valid, test


def build_datasets(
    cfg: Any, vocab: VocabInfo, samples: tuple[int, int, int], cache_dir: Path
) -> tuple[Any, Any, Any]:
    """GPT's next-token samples."""
    data = cfg.model.data
    return build_splits(
        cfg,
        GPTDataset,
        GPTDatasetConfig,
        vocab,
        samples,
        cache_dir,
        reset_position_ids=bool(data.get("reset_position_ids", False)),
        reset_attention_mask=bool(data.get("reset_attention_mask", False)),
        eod_mask_loss=bool(data.get("eod_mask_loss", False)),
        create_attention_mask=False,  # causal masking is done by the attention kernel
    )


# What a micro-batch holds; packed fine-tuning data adds its attention mask.
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")


class SampleStream:
    """A dataset read as consecutive global batches, this data-parallel rank's share of each."""

    def __init__(self, dataset: Any, micro_batch_size: int, keys: tuple[str, ...] = BATCH_KEYS):
        self.dataset = dataset
        self.keys = keys
        self.micro_batch_size = micro_batch_size
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()

    def micro_batches(self, start_sample: int, count: int) -> Iterator[dict[str, torch.Tensor]]:
        """`count` micro-batches for this rank, the first one starting at global `start_sample`."""
        step = self.micro_batch_size * self.dp_size
        for index in range(count):
            first = start_sample + index * step + self.dp_rank * self.micro_batch_size
            items = [
                self.dataset[(first + offset) % len(self.dataset)]
                for offset in range(self.micro_batch_size)
            ]
            yield {
                # GPTDataset gives tensors, the BERT and T5 datasets numpy arrays.
                name: torch.stack([torch.as_tensor(item[name]) for item in items])
                for name in self.keys
                if name in items[0]
            }


def evaluated_rows(
    outputs: list[dict[str, torch.Tensor]],
    key: str,
    count: int,
    micro_batch_size: int,
    global_batch_size: int,
    rows_per_sample: int = 1,
    everywhere: bool = True,
) -> list[torch.Tensor] | None:
    """The first `count` rows of a SampleStream evaluated from its start in whole global
    batches, in the stream's order, from each micro-batch report's `key` ([rows, ...]; a
    sample is `rows_per_sample` of the stream's sequences, as a preference pair is two): each
    data-parallel rank's micro-batches placed where `micro_batches` took them. On every rank
    (`everywhere`), else on rank 0 and None elsewhere."""
    dp_size = parallel_state.get_data_parallel_world_size()
    per_batch = global_batch_size // (micro_batch_size * dp_size)
    mine = []
    if outputs and parallel_state.get_tensor_model_parallel_rank() == 0:
        dp_rank = parallel_state.get_data_parallel_rank()
        for position, output in enumerate(outputs):
            batch, micro = divmod(position, per_batch)
            first = (
                batch * global_batch_size
                + micro * micro_batch_size * dp_size
                + dp_rank * micro_batch_size
            )
            mine.append((first // rows_per_sample, output[key].cpu()))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if everywhere:
        gathered: list[Any] = [None] * world
        torch.distributed.all_gather_object(gathered, mine)
    else:
        gathered = [None] * world if rank == 0 else []
        torch.distributed.gather_object(mine, gathered if rank == 0 else None, dst=0)
        if rank != 0:
            return None
    found: dict[int, torch.Tensor] = {}
    for pieces in gathered:
        for first, rows in pieces:
            for offset, row in enumerate(rows):
                found[first + offset] = row
    return [found[index] for index in range(count)]
