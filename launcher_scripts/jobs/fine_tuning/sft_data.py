"""Supervised fine-tuning data: JSONL records turned into token ids and a loss mask.

Two record shapes, told apart per line:
  - prompt/answer: `{"input": ..., "output": ...}` (the keys are `context_key`/`label_key`),
    rendered through `prompt_template`, e.g. "{input} Answer: {output}". Everything before the
    label's placeholder is the prompt; the label and what follows is the answer.
  - chat: `{"system": ..., "conversations": [{"from": role, "value": text}, ...], "mask": role}`;
    the turns of the `mask` role (and every turn header) carry no loss.

A sample longer than `max_seq_length` loses tokens from the side `truncation_field` names
(`context`: the end of the prompt, so the answer is kept whole; `answer`: the end of the answer);
a sample whose answer cannot fit even with no prompt is dropped. Both are counted and reported,
never silent.
"""

from __future__ import annotations

import json
import math
import random
import string
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import zip_longest
from pathlib import Path
from typing import Any, Protocol

import torch

from launcher_scripts.errors import RecipeError

TRUNCATION_FIELDS = ("context", "answer")
CHAT_KEYS = ("conversations",)


class Tokenizer(Protocol):
    eod_id: int

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class SftFormat:
    """How records become tokens; read from one `model.data.<split>_ds` section."""

    prompt_template: str = "{input} {output}"
    context_key: str = "input"
    label_key: str = "output"
    max_seq_length: int = 2048
    min_seq_length: int = 1
    answer_only_loss: bool = True
    add_bos: bool = False
    add_eos: bool = True
    add_sep: bool = False
    truncation_field: str = "context"
    virtual_tokens: int = 0  # prompt-learning placeholders before each sample, never in the loss
    # Text to text (an encoder-decoder): the answer's own limit; max_seq_length is the input's.
    max_target_length: int | None = None

    @classmethod
    def from_section(
        cls, section: Any, key: str, answer_only_loss: bool, virtual_tokens: int
    ) -> SftFormat:
        template = section.get("prompt_template")
        context_key = str(section.get("context_key") or "input")
        label_key = str(section.get("label_key") or "output")
        if not template:
            joiner = "\n" if section.get("separate_prompt_and_response_with_newline") else " "
            template = f"{{{context_key}}}{joiner}{{{label_key}}}"
        fmt = cls(
            prompt_template=str(template),
            context_key=context_key,
            label_key=label_key,
            max_seq_length=int(section.get("max_seq_length") or 2048),
            min_seq_length=int(section.get("min_seq_length") or 1),
            answer_only_loss=answer_only_loss,
            add_bos=bool(section.get("add_bos", False)),
            add_eos=bool(section.get("add_eos", True)),
            add_sep=bool(section.get("add_sep", False)),
            truncation_field=str(section.get("truncation_field") or "context"),
            virtual_tokens=virtual_tokens,
            max_target_length=int(target)
            if (target := section.get("max_tgt_seq_length"))
            else None,
        )
        fmt.check(key)
        return fmt

    def check(self, key: str) -> None:
        fields = template_fields(self.prompt_template)
        if self.label_key not in fields:
            raise RecipeError(
                f"{key}.prompt_template: {self.prompt_template!r} has no {{{self.label_key}}} "
                f"placeholder for the answer (label_key is {self.label_key!r}): add it at the end"
            )
        if self.truncation_field not in TRUNCATION_FIELDS:
            raise RecipeError(
                f"{key}.truncation_field: {self.truncation_field!r} is not one of "
                f"{', '.join(TRUNCATION_FIELDS)}"
            )
        if self.max_seq_length < 2 + self.virtual_tokens:
            raise RecipeError(
                f"{key}.max_seq_length: {self.max_seq_length} leaves no room for a sample "
                f"(virtual tokens: {self.virtual_tokens}): raise it"
            )
        if self.max_target_length is not None and self.max_target_length < 2:
            raise RecipeError(
                f"{key}.max_tgt_seq_length: {self.max_target_length} leaves no room for an "
                "answer and its end token: raise it"
            )


def template_fields(template: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


@dataclass
class Encoded:
    ids: list[int]
    loss: list[int]  # 1 where the token is to be predicted (aligned with ids)
    prompt_length: int  # ids of the prompt, for generation (after any virtual tokens)


@dataclass
class Counts:
    read: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    dropped_too_short: int = 0
    examples: list[str] = field(default_factory=list)  # "file:line" of the first few changes

    def note(self, where: str) -> None:
        if len(self.examples) < 3:
            self.examples.append(where)

    def report(self, label: str, fmt: SftFormat) -> str | None:
        if not (self.truncated or self.dropped_too_long or self.dropped_too_short):
            return None
        parts = []
        if self.truncated:
            side = "prompt" if fmt.truncation_field == "context" else "answer"
            parts.append(f"{self.truncated} truncated (end of the {side})")
        if self.dropped_too_long:
            parts.append(f"{self.dropped_too_long} dropped: the answer alone exceeds the limit")
        if self.dropped_too_short:
            parts.append(f"{self.dropped_too_short} dropped: shorter than min_seq_length")
        return (
            f"{label}: of {self.read} samples, {'; '.join(parts)} at max_seq_length "
            f"{fmt.max_seq_length} (first: {', '.join(self.examples)})"
        )


@dataclass
class Record:
    prompt: str  # what generation continues
    answer: str  # the reference answer(s) for exact match: the first is the label
    answers: list[str]
    source: str  # file:line
    encoded: Encoded


def _split_template(fmt: SftFormat, record: dict[str, Any], where: str) -> tuple[str, str]:
    """(prompt text, answer text): the template before the label and from the label on.
    Whitespace before the label goes with the answer, as a tokenizer sees it mid-text."""
    marker = "{" + fmt.label_key + "}"
    cut = fmt.prompt_template.index(marker)
    head, tail = fmt.prompt_template[:cut], fmt.prompt_template[cut:]
    stripped = head.rstrip(" ")
    head, tail = stripped, head[len(stripped) :] + tail
    try:
        return head.format_map(record), tail.format_map(record)
    except KeyError as missing:
        raise SftDataError(
            f"{where}: the record has no key {missing} that the prompt template uses"
        ) from None


class SftDataError(ValueError):
    pass


def _assemble(
    fmt: SftFormat, tokenizer: Tokenizer, prompt_ids: list[int], answer_ids: list[int]
) -> tuple[list[int], list[int], list[int]]:
    """(prefix, prompt, answer) ids with the special tokens the format asks for."""
    prefix = [tokenizer.eod_id] * fmt.virtual_tokens
    if fmt.add_bos:
        prefix.append(getattr(tokenizer, "bos_id", tokenizer.eod_id))
    prompt = list(prompt_ids) + ([tokenizer.eod_id] if fmt.add_sep else [])
    answer = list(answer_ids) + ([tokenizer.eod_id] if fmt.add_eos else [])
    return prefix, prompt, answer


def encode_record(
    tokenizer: Tokenizer, fmt: SftFormat, prompt: str, answer: str, counts: Counts, where: str
) -> Encoded | None:
    prompt_ids = tokenizer.encode(prompt) if prompt else []
    prefix, prompt_ids, answer_ids = _assemble(fmt, tokenizer, prompt_ids, tokenizer.encode(answer))
    over = len(prefix) + len(prompt_ids) + len(answer_ids) - fmt.max_seq_length
    if over > 0:
        if fmt.truncation_field == "context":
            if over > len(prompt_ids):
                counts.dropped_too_long += 1
                counts.note(where)
                return None
            prompt_ids = prompt_ids[: len(prompt_ids) - over]
        else:
            if over >= len(answer_ids):
                counts.dropped_too_long += 1
                counts.note(where)
                return None
            answer_ids = answer_ids[: len(answer_ids) - over]
        counts.truncated += 1
        counts.note(where)
    ids = prefix + prompt_ids + answer_ids
    if len(ids) < fmt.min_seq_length:
        counts.dropped_too_short += 1
        return None
    prompt_loss = 0 if fmt.answer_only_loss else 1
    loss = [0] * len(prefix) + [prompt_loss] * len(prompt_ids) + [1] * len(answer_ids)
    return Encoded(ids, loss, len(prompt_ids))


def encode_chat(
    tokenizer: Tokenizer, fmt: SftFormat, record: dict[str, Any], counts: Counts, where: str
) -> Encoded | None:
    """System text, then per turn a header "\\n{role}: " (no loss) and the turn's text (loss
    unless the role is the record's `mask`). Over-long chats lose whole turns from the end,
    keeping at least the first answer that carries loss."""
    masked_role = record.get("mask", "User")
    turns = record.get("conversations")
    if not isinstance(turns, list) or not all(
        isinstance(t, dict) and "from" in t and "value" in t for t in turns
    ):
        raise SftDataError(f"{where}: `conversations` must be a list of {{from, value}} objects")
    prefix, _, _ = _assemble(fmt, tokenizer, [], [])
    ids = list(prefix)
    loss = [0] * len(prefix)
    system = str(record.get("system") or "")
    if system:
        ids += tokenizer.encode(system)
        loss += [0] * (len(ids) - len(loss))
    kept_any_loss = False
    for turn in turns:
        header = tokenizer.encode(f"\n{turn['from']}: ")
        body = tokenizer.encode(str(turn["value"]))
        learned = turn["from"] != masked_role
        if len(ids) + len(header) + len(body) + int(fmt.add_eos) > fmt.max_seq_length:
            counts.truncated += 1
            counts.note(where)
            break
        ids += header + body
        loss += [0] * len(header) + [int(learned)] * len(body)
        kept_any_loss |= learned
    if not kept_any_loss:
        counts.dropped_too_long += 1
        return None
    if fmt.add_eos:
        ids.append(tokenizer.eod_id)
        loss.append(loss[-1])
    return Encoded(ids, loss, len(ids))


# (tokenizer, format, prompt, answer, counts, "file:line") -> the sample, or None: dropped
RecordEncoder = Callable[[Any, SftFormat, str, str, Counts, str], Encoded | None]


def json_lines(path: Path) -> Iterator[tuple[str, Any]]:
    """Each non-blank line's JSON value, with its "file:line"; SftDataError naming the first
    line that is not JSON."""
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as error:
                raise SftDataError(f"{where}: not JSON ({error.msg})") from None


def read_records(
    path: Path,
    tokenizer: Tokenizer,
    fmt: SftFormat,
    counts: Counts,
    encode: RecordEncoder = encode_record,
    chat: bool = True,
) -> Iterator[Record]:
    for where, record in json_lines(path):
        if not isinstance(record, dict):
            raise SftDataError(f"{where}: a line must hold a JSON object")
        counts.read += 1
        if any(k in record for k in CHAT_KEYS):
            if not chat:
                raise SftDataError(
                    f"{where}: a chat record, which this model cannot be tuned on: give "
                    f"{fmt.context_key!r}/{fmt.label_key!r} records (or src/tgt text files)"
                )
            encoded = encode_chat(tokenizer, fmt, record, counts, where)
            prompt, answer, answers = "", "", []
        else:
            if fmt.label_key not in record:
                raise SftDataError(
                    f"{where}: no {fmt.label_key!r} key (label_key); the line has "
                    f"{', '.join(sorted(record)) or 'no keys'}"
                )
            prompt, answer = _split_template(fmt, record, where)
            encoded = encode(tokenizer, fmt, prompt, answer, counts, where)
            label = str(record[fmt.label_key])
            extra = record.get("original_answers") or []
            answers = [label, *(str(a) for a in extra if str(a) != label)]
        if encoded is not None:
            yield Record(prompt, answer, answers, where, encoded)


def read_pairs(
    source: Path,
    target: Path,
    tokenizer: Tokenizer,
    fmt: SftFormat,
    counts: Counts,
    encode: RecordEncoder = encode_record,
) -> Iterator[Record]:
    """Text to text: line i of `source` is an input, line i of `target` its answer."""
    with source.open(encoding="utf-8") as inputs, target.open(encoding="utf-8") as answers:
        for number, (prompt, answer) in enumerate(zip_longest(inputs, answers), 1):
            if prompt is None or answer is None:
                shorter, longer = (source, target) if prompt is None else (target, source)
                raise SftDataError(
                    f"{shorter} ends at line {number - 1} and {longer} goes on: give the "
                    "inputs and their answers line for line"
                )
            prompt, answer = prompt.rstrip("\r\n"), answer.rstrip("\r\n")
            if not prompt.strip():
                continue
            where = f"{source}:{number}"
            counts.read += 1
            encoded = encode(tokenizer, fmt, prompt, answer, counts, where)
            if encoded is not None:
                yield Record(prompt, answer, [answer], where, encoded)


@dataclass
class SftFile:
    path: Path
    records: list[Record]


def load_files(
    paths: Sequence[Path],
    tokenizer: Tokenizer,
    fmt: SftFormat,
    label: str,
    targets: Sequence[Path] = (),
    encode: RecordEncoder = encode_record,
    chat: bool = True,
) -> tuple[list[SftFile], str | None]:
    """Every file tokenized (JSONL records, or with `targets` text-to-text line pairs); plus
    the truncation report line, if any sample was changed."""
    counts = Counts()
    if targets:
        files = [
            SftFile(p, list(read_pairs(p, t, tokenizer, fmt, counts, encode)))
            for p, t in zip(paths, targets, strict=True)
        ]
    else:
        files = [
            SftFile(p, list(read_records(p, tokenizer, fmt, counts, encode, chat))) for p in paths
        ]
    for item in files:
        if not item.records:
            raise SftDataError(f"{item.path}: no usable samples ({label})")
    return files, counts.report(label, fmt)


def temperature_weights(files: Sequence[SftFile], temperature: float) -> tuple[float, ...]:
    """Sampling weights p_i ~ n_i^(1/T) from the files' record counts: T = 1 in proportion to
    their sizes, a larger T closer to uniform (NeMo's temperature sampling)."""
    scaled = [len(item.records) ** (1.0 / temperature) for item in files]
    return tuple(value / sum(scaled) for value in scaled)


def to_tensors(encoded: Encoded, seq_length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Model inputs for one sample, right-padded to `seq_length` positions: tokens are ids[:-1],
    labels ids[1:], and a label's loss is the mask of the token it predicts."""
    ids = encoded.ids[: seq_length + 1]
    count = len(ids) - 1
    tokens = torch.full((seq_length,), pad_id, dtype=torch.long)
    labels = torch.full((seq_length,), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(seq_length, dtype=torch.float)
    tokens[:count] = torch.tensor(ids[:-1])
    labels[:count] = torch.tensor(ids[1:])
    loss_mask[:count] = torch.tensor(encoded.loss[1 : count + 1], dtype=torch.float)
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": torch.arange(seq_length, dtype=torch.long),
    }


# (a sample, or None for loss-free padding) -> the model's inputs for it
SampleMaker = Callable[[Encoded | None], dict[str, torch.Tensor]]


def padded_sample(seq_length: int, pad_id: int, encoded: Encoded | None) -> dict[str, torch.Tensor]:
    """A decoder-only model's sample (to_tensors); None: a loss-free one of padding."""
    return to_tensors(encoded or Encoded([pad_id, pad_id], [0, 0], 0), seq_length, pad_id)


class MixedSamples:
    """Training samples drawn from several files in the proportions of
    `concat_sampling_probabilities`, the same sequence on every rank and every resume.

    Sample k goes to the file furthest below its share after k samples; each file is walked
    in a fresh seeded order every epoch (or in file order when `shuffle` is off).
    """

    def __init__(
        self,
        files: list[SftFile],
        weights: Sequence[float],
        total: int,
        seq_length: int,
        pad_id: int,
        seed: int,
        shuffle: bool,
        make_sample: SampleMaker | None = None,
    ) -> None:
        self.files, self.weights, self.seq_length, self.pad_id = files, weights, seq_length, pad_id
        self.seed, self.shuffle, self.total = seed, shuffle, total
        self.make_sample = make_sample or partial(padded_sample, seq_length, pad_id)
        self._counts = [0] * len(files)
        self.choice: list[tuple[int, int]] = []
        self._extend(total)
        self._orders: dict[tuple[int, int], list[int]] = {}

    def _extend(self, count: int) -> None:
        """Draw sources until `count` samples are drawn."""
        counts = self._counts
        for k in range(len(self.choice), count):
            source = max(
                range(len(self.files)), key=lambda i: self.weights[i] * (k + 1) - counts[i]
            )
            self.choice.append((source, counts[source]))
            counts[source] += 1

    def __len__(self) -> int:
        return self.total

    def _order(self, source: int, epoch: int) -> list[int]:
        key = (source, epoch)
        if key not in self._orders:
            order = list(range(len(self.files[source].records)))
            if self.shuffle:
                random.Random(self.seed * 7919 + source * 104729 + epoch).shuffle(order)
            self._orders[key] = order
        return self._orders[key]

    def encoded(self, index: int) -> Encoded:
        """The `index`-th sample of the stream (which goes on past `total` when asked)."""
        self._extend(index + 1)
        source, nth = self.choice[index]
        records = self.files[source].records
        epoch, position = divmod(nth, len(records))
        return records[self._order(source, epoch)[position]].encoded

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.make_sample(self.encoded(index % self.total))


class EvalSamples:
    """Every record once, in file order, then loss-free padding up to whole global batches."""

    def __init__(
        self,
        files: list[SftFile],
        global_batch: int,
        seq_length: int,
        pad_id: int,
        make_sample: SampleMaker | None = None,
    ) -> None:
        self.records = [record for item in files for record in item.records]
        self.make_sample = make_sample or partial(padded_sample, seq_length, pad_id)
        self.batches = math.ceil(len(self.records) / global_batch)
        self.length = self.batches * global_batch

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.make_sample(self.records[index].encoded if index < len(self.records) else None)
