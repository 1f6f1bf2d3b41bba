"""Preference pairs, as the reward model (and DPO) train on them: read, encoded, batched.

Two layouts (recipes/tuning.py `_data_prefix_layout`):
  - JSONL: {"prompt": text or chat turns, "chosen": text, "rejected": text} per line (what
    jobs/data_prep/preference_convert.py writes). Turns are rendered with the tokenizer's chat
    template when its tokenizer_config.json has one, else as "role: text" lines;
  - the reference's: data_preparation's indexed files, whose consecutive documents are a
    prompt with its chosen answer, then with its rejected one (a trailing end-of-document
    token is dropped: the reward is read at the text's last token).

A sample is one sequence: pair i is samples 2i (chosen) and 2i + 1 (rejected), so a
micro-batch of an even number of samples holds whole pairs. Answers longer than the sequence
allows are cut at the end (counted and reported); a prompt that leaves no room for an answer
stops the run with its file and line.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from launcher_scripts.formats.preference import preference_problem
from launcher_scripts.jobs.fine_tuning.sft_data import SftDataError, json_lines
from launcher_scripts.jobs.training import data

SAMPLE_KEYS = ("tokens", "position_ids", "lengths")


@dataclass(frozen=True)
class Pair:
    prompt: list[int]  # empty for the indexed layout (the whole document is the answer)
    chosen: list[int]
    rejected: list[int]
    where: str  # file:line, for messages

    def side(self, rejected: bool) -> list[int]:
        return self.prompt + (self.rejected if rejected else self.chosen)


@dataclass
class Counts:
    read: int = 0
    truncated: int = 0


def chat_template(tokenizer_section: Any) -> str | None:
    """The chat template of an imported model's tokenizer_config.json, or None."""
    config = tokenizer_section.get("hf_config") if tokenizer_section is not None else None
    if not config or not Path(str(config)).is_file():
        return None
    template = json.loads(Path(str(config)).read_text(encoding="utf-8")).get("chat_template")
    return template if isinstance(template, str) and template else None


def prompt_text(prompt: str | list[dict[str, str]], template: str | None) -> str:
    """A prompt as the model reads it: a text as it is; turns through the chat template, with
    the assistant's turn opened."""
    if isinstance(prompt, str):
        return prompt
    if template is None:
        lines = [f"{turn['role']}: {turn['content']}\n" for turn in prompt]
        return "".join(lines) + "assistant:"
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    rendered = environment.from_string(template).render(
        messages=prompt, add_generation_prompt=True, bos_token="", eos_token=""
    )
    return str(rendered)


def _fit(pair: Pair, seq_length: int, counts: Counts) -> Pair:
    """The pair with each answer cut to what the sequence leaves after the prompt."""
    room = seq_length - len(pair.prompt)
    if room < 1:
        raise SftDataError(
            f"{pair.where}: the prompt is {len(pair.prompt)} tokens and the sequence "
            f"{seq_length}: no room for an answer. Raise model.data.seq_length or leave the "
            "record out"
        )
    if len(pair.chosen) > room or len(pair.rejected) > room:
        counts.truncated += 1
    return Pair(pair.prompt, pair.chosen[:room], pair.rejected[:room], pair.where)


def read_jsonl(
    path: Path,
    tokenizer: Any,
    template: str | None,
    seq_length: int,
    counts: Counts,
    answer_end: Sequence[int] = (),
) -> Iterator[Pair]:
    for where, record in json_lines(path):
        problem = preference_problem(record)
        if problem is not None:
            raise SftDataError(f"{where}: {problem}")
        counts.read += 1
        prompt = tokenizer.encode(prompt_text(record["prompt"], template))
        chosen, rejected = (
            tokenizer.encode(record[k]) + list(answer_end) for k in ("chosen", "rejected")
        )
        yield _fit(Pair(prompt, chosen, rejected, where), seq_length, counts)


def read_indexed(
    prefix: Path, eod_id: int, seq_length: int, counts: Counts, split_prompt: bool = False
) -> Iterator[Pair]:
    """Pairs of consecutive documents. A reward model reads each whole, without its trailing
    end-of-document token; with `split_prompt` (DPO) the tokens both share from the start are
    the prompt, and each answer keeps its end-of-document token."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    documents = IndexedDataset(str(prefix))
    if len(documents) % 2:
        raise SftDataError(
            f"{prefix}: {len(documents)} documents: pairs need an even count (each prompt "
            "with its chosen answer, then with its rejected one)"
        )
    for index in range(0, len(documents), 2):
        where = f"{prefix} documents {index}-{index + 1}"
        sides = [[int(t) for t in documents[i]] for i in (index, index + 1)]
        if not split_prompt:
            sides = [ids[:-1] if ids and ids[-1] == eod_id else ids for ids in sides]
        if sides[0] == sides[1]:
            raise SftDataError(f"{where}: chosen and rejected are the same text")
        shared = 0
        if split_prompt:
            while shared < min(map(len, sides)) and sides[0][shared] == sides[1][shared]:
                shared += 1
            if shared in (len(sides[0]), len(sides[1])):
                raise SftDataError(
                    f"{where}: one document is the start of the other: each needs an answer "
                    "after the prompt they share"
                )
        counts.read += 1
        pair = Pair(sides[0][:shared], sides[0][shared:], sides[1][shared:], where)
        yield _fit(pair, seq_length, counts)


def load_pairs(
    files: Sequence[Path],
    tokenizer: Any,
    template: str | None,
    seq_length: int,
    label: str,
    generative: bool = False,
) -> tuple[list[Pair], str]:
    """Every pair of the files, and a line saying what was read. `generative` (DPO): each
    answer ends with the end-of-document token, and an indexed pair's shared start is its
    prompt."""
    counts = Counts()
    pairs: list[Pair] = []
    end = [tokenizer.eod_id] if generative else []
    for path in files:
        if path.suffix in (".jsonl", ".json"):
            pairs += read_jsonl(path, tokenizer, template, seq_length, counts, end)
        else:
            pairs += read_indexed(path, tokenizer.eod_id, seq_length, counts, generative)
    if not pairs:
        raise SftDataError(f"{label}: {', '.join(map(str, files))} hold no preference pair")
    report = f"{label}: {len(pairs)} preference pairs"
    if counts.truncated:
        report += f" ({counts.truncated} with an answer cut to the sequence length)"
    return pairs, report


def count_pairs(path: Path) -> int:
    """The pairs a file holds, without encoding them (for max_steps from epochs)."""
    if path.suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8") as lines:
            return sum(1 for line in lines if line.strip())
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return len(IndexedDataset(str(path))) // 2


def sample(ids: Sequence[int], seq_length: int, pad_id: int) -> dict[str, torch.Tensor]:
    tokens = torch.full((seq_length,), pad_id, dtype=torch.long)
    tokens[: len(ids)] = torch.tensor(list(ids), dtype=torch.long)
    return {
        "tokens": tokens,
        "position_ids": torch.arange(seq_length, dtype=torch.long),
        "lengths": torch.tensor(len(ids), dtype=torch.long),
    }


# (pair index, the pair or None for padding, whether the rejected side) -> a sample
SampleOf = Callable[[int, "Pair | None", bool], dict[str, torch.Tensor]]


def scored_sample(seq_length: int, pad_id: int) -> SampleOf:
    """A reward model's sample: the side's whole text, its length (0: padding)."""

    def make(index: int, pair: Pair | None, rejected: bool) -> dict[str, torch.Tensor]:
        del index
        return sample(pair.side(rejected) if pair else [], seq_length, pad_id)

    return make


def epoch_order(count: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The order records are read in during an epoch: shuffled anew each epoch by the seed."""
    order = list(range(count))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


class PairSamples:
    """`pairs` shuffled anew each epoch (by `seed`), as 2 x `count` samples: chosen, then
    rejected, of each pair in turn."""

    def __init__(
        self, pairs: list[Pair], count: int, make: SampleOf, seed: int, shuffle: bool
    ) -> None:
        self.pairs, self.make = pairs, make
        self.count, self.seed, self.shuffle = count, seed, shuffle
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return 2 * self.count

    def pair_index(self, index: int) -> int:
        epoch, position = divmod(index, len(self.pairs))
        order = self._orders.get(epoch)
        if order is None:
            order = epoch_order(len(self.pairs), self.seed, epoch, self.shuffle)
            self._orders = {epoch: order}  # epochs are read in turn
        return order[position]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        pair = self.pair_index(index // 2)
        return self.make(pair, self.pairs[pair], bool(index % 2))


class EvalPairs:
    """Every pair once, in order, then padding samples (which the losses leave out) up to a
    whole number of global batches of `batch` samples."""

    def __init__(self, pairs: list[Pair], batch: int, make: SampleOf) -> None:
        self.pairs, self.make = pairs, make
        self.batches = -(-2 * len(pairs) // batch)
        self.size = self.batches * batch

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        pair = index // 2
        real = self.pairs[pair] if pair < len(self.pairs) else None
        return self.make(pair, real, bool(index % 2))


def pair_values(
    trainer: Any, outputs: list[dict[str, torch.Tensor]], pairs: int, key: str
) -> list[list[float]] | None:
    """The (chosen, rejected) values of the first `pairs` pairs of an evaluated EvalPairs
    stream, in its order, from each micro-batch report's `key` ([pairs, 2]), on rank 0 (None
    elsewhere)."""
    model = trainer.cfg.model
    rows = data.evaluated_rows(
        outputs,
        key,
        pairs,
        int(model.micro_batch_size),
        int(model.global_batch_size),
        rows_per_sample=2,
        everywhere=False,
    )
    return None if rows is None else [row.double().tolist() for row in rows]


def reduced_sums(
    outputs: list[dict[str, torch.Tensor]], key: str, names: Sequence[str], device: str
) -> dict[str, float]:
    """Each named sum of the micro-batch reports' `key` over every rank (the same on every
    rank; tensor-parallel ranks repeat every sum alike, so ratios of them stand)."""
    sums = torch.zeros(len(names), dtype=torch.float64, device=device)
    for output in outputs:
        sums += output[key].double()
    dist.all_reduce(sums)
    return dict(zip(names, sums.tolist(), strict=True))


def mean_loss(outputs: list[dict[str, torch.Tensor]], device: str) -> float:
    """The loss per pair over every rank's micro-batches."""
    total, pairs = reduced_sums(outputs, "lm loss", ("loss", "pairs"), device).values()
    return total / max(pairs, 1.0)
