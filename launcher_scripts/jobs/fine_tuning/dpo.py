"""Direct preference optimisation's training task (the dpo stage).

The policy (a portable file, usually an SFT result; every weight or LoRA) learns from
preference pairs against a frozen reference: the starting policy itself, or
`model.dpo.reference_model`, a file of the same architecture and tokenizer. The reference's
log-probabilities of every pair's answers are computed once, before training, with the
model's own modules (the reference's weights loaded into them, then the policy's back; with
LoRA the adapters start at zero, so the starting policy is the base with them off), and kept
beside the checkpoints (reference_logps.pt): no second copy of the weights is held. Losses
(recipes/preference.py): sigmoid DPO with label smoothing, IPO, and an SFT term on the chosen
answer (RPO). Validation logs what practitioners read: the implicit rewards of the chosen and
rejected answers, their margin, the share of pairs ranked right, both log-probabilities; they
are plotted beside the loss curve (dpo_curves.png).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from launcher_scripts.files import write_atomic
from launcher_scripts.formats import portable
from launcher_scripts.jobs.fine_tuning import peft
from launcher_scripts.jobs.fine_tuning.preference_data import (
    Pair,
    PairSamples,
    SampleOf,
    mean_loss,
    pair_values,
    reduced_sums,
)
from launcher_scripts.jobs.fine_tuning.preference_task import PreferenceTask
from launcher_scripts.jobs.fine_tuning.sft_data import SftDataError
from launcher_scripts.jobs.fine_tuning.tuner import bare_chunks
from launcher_scripts.jobs.training import data, init_weights, metrics
from launcher_scripts.jobs.training.trainer import Streams, Trainer
from launcher_scripts.recipes.preference import DpoSettings

KEYS = ("tokens", "position_ids", "labels", "loss_mask", "lengths", "ref_logps")
PACKED_KEYS = (
    "tokens",
    "position_ids",
    "labels",
    "loss_mask",
    "attention_mask",
    "segment",
    "segment_ref",
    "segment_real",
)
# The sums one micro-batch reports, in this order.
STATS = (
    "pairs",
    "rewards_chosen",
    "rewards_rejected",
    "accuracy",
    "margin",
    "logps_chosen",
    "logps_rejected",
)


def dpo_sample(seq_length: int, pad_id: int, reference: torch.Tensor | None) -> SampleOf:
    """A policy sample: the side's tokens, next-token labels, the answer's tokens in the loss
    mask, and the reference's log-probability of the answer (`reference` [pairs, 2]; zeros
    while it is being computed)."""

    def make(index: int, pair: Pair | None, rejected: bool) -> dict[str, torch.Tensor]:
        ids = pair.side(rejected) if pair is not None else []
        tokens = torch.full((seq_length,), pad_id, dtype=torch.long)
        tokens[: len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels = torch.full((seq_length,), pad_id, dtype=torch.long)
        labels[: max(len(ids) - 1, 0)] = tokens[1 : len(ids)]
        mask = torch.zeros(seq_length, dtype=torch.float)
        if pair is not None:  # position t predicts token t + 1: the answer's, after the prompt
            mask[max(len(pair.prompt) - 1, 0) : len(ids) - 1] = 1.0
        known = reference is not None and pair is not None
        return {
            "tokens": tokens,
            "position_ids": torch.arange(seq_length, dtype=torch.long),
            "labels": labels,
            "loss_mask": mask,
            "lengths": torch.tensor(len(ids), dtype=torch.long),
            "ref_logps": reference[index, int(rejected)].clone() if known else torch.tensor(0.0),
        }

    return make


@dataclass
class Sides:
    """A micro-batch's pairs, side by side: each answer's log-probability under the policy,
    under the reference, its token count, and whether the pair is real (not padding)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    reference_chosen: torch.Tensor
    reference_rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    real: torch.Tensor

    @classmethod
    def of_rows(cls, batch: dict[str, torch.Tensor], token_logps: torch.Tensor) -> Sides:
        """Rows 2i chosen, 2i + 1 rejected (a pair of empty rows is padding)."""
        mask = batch["loss_mask"].to(token_logps)
        logps, counts = (token_logps * mask).sum(dim=1), mask.sum(dim=1).clamp(min=1.0)
        reference = batch["ref_logps"].to(token_logps)
        return cls(
            logps[0::2], logps[1::2], reference[0::2], reference[1::2],
            counts[0::2], counts[1::2], (batch["lengths"][0::2] > 0).to(token_logps),
        )  # fmt: skip

    @classmethod
    def of_packs(cls, batch: dict[str, torch.Tensor], token_logps: torch.Tensor) -> Sides:
        """Packed rows: each side a segment (2j chosen, 2j + 1 rejected of the row's pair j;
        -1 padding), summed per segment."""
        mask = batch["loss_mask"].to(token_logps)
        segment = batch["segment"].to(token_logps.device)
        index, inside = segment.clamp(min=0), (segment >= 0).to(token_logps)
        shape = batch["segment_ref"].shape
        logps = token_logps.new_zeros(shape).scatter_add_(1, index, token_logps * mask * inside)
        counts = token_logps.new_zeros(shape).scatter_add_(1, index, mask * inside)
        reference = batch["segment_ref"].to(token_logps)
        real = batch["segment_real"].to(token_logps)[:, 0::2]
        return cls(
            *(t.reshape(-1) for t in (logps[:, 0::2], logps[:, 1::2])),
            *(t.reshape(-1) for t in (reference[:, 0::2], reference[:, 1::2])),
            *(t.clamp(min=1.0).reshape(-1) for t in (counts[:, 0::2], counts[:, 1::2])),
            real.reshape(-1),
        )


def preference_loss(
    settings: DpoSettings, batch: dict[str, torch.Tensor], output: torch.Tensor
) -> tuple[Any, Any, Any]:
    """The summed loss of a micro-batch's real pairs, their count, and the STATS sums beside
    it; `output` is the model's per-token negative log-likelihood of the labels."""
    token_logps = -output.float()
    packed = "segment" in batch
    sides = Sides.of_packs(batch, token_logps) if packed else Sides.of_rows(batch, token_logps)
    chosen, rejected, real = sides.chosen, sides.rejected, sides.real
    chosen_ratio = chosen - sides.reference_chosen
    rejected_ratio = rejected - sides.reference_rejected
    beta = settings.beta
    if settings.loss == "ipo":  # per-token log ratios, as the IPO authors' results use
        delta = chosen_ratio / sides.chosen_tokens - rejected_ratio / sides.rejected_tokens
        losses = (delta - 1 / (2 * beta)) ** 2
    else:
        delta = chosen_ratio - rejected_ratio
        smoothing = settings.label_smoothing
        losses = -(1 - smoothing) * F.logsigmoid(beta * delta) - smoothing * F.logsigmoid(
            -beta * delta
        )
    if settings.sft_loss_weight:  # RPO: the chosen answer's mean negative log-likelihood
        losses = losses + settings.sft_loss_weight * (-chosen / sides.chosen_tokens)
    loss = torch.sum(losses * real)
    pairs = real.sum()
    chosen_rewards, rejected_rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    stats = torch.stack(
        [
            pairs,
            (chosen_rewards * real).sum(),
            (rejected_rewards * real).sum(),
            ((chosen_rewards > rejected_rewards).to(real) * real).sum(),
            ((chosen_rewards - rejected_rewards) * real).sum(),
            (chosen.detach() * real).sum(),
            (rejected.detach() * real).sum(),
        ]
    )
    report = {
        "lm loss": torch.stack([loss.detach(), pairs]),
        "preference": stats,
        "pair_logps": torch.stack([chosen, rejected], dim=1).detach(),
    }
    return loss, pairs.to(torch.int), report


class PackedPairs:
    """Whole pairs, in the order of a PairSamples stream, packed into rows of `seq_length`
    positions while they fit: each side a segment with its own positions (from 0) that sees
    only itself (a block-diagonal causal mask), the pair's chosen side then its rejected one.
    The packing is a pure function of the stream: the same on every rank and after a resume.
    Each row carries its segments' reference log-probabilities and which are real."""

    def __init__(
        self,
        stream: PairSamples,
        rows: int,
        seq_length: int,
        pad_id: int,
        reference: torch.Tensor,
    ) -> None:
        self.stream, self.rows, self.seq_length = stream, rows, seq_length
        self.pad_id, self.reference = pad_id, reference
        # A side of one token has no position to predict: at least 2 positions per pair.
        self.segments = 2 * max(1, seq_length // 2)
        self._starts = [0]  # the first stream pair of each row computed so far, and the next
        for pair in stream.pairs:
            width = sum(len(pair.side(rejected)) - 1 for rejected in (False, True))
            if width > seq_length:
                raise SftDataError(
                    f"{pair.where}: its two sides need {width} positions, and a packed "
                    f"sequence holds {seq_length}: raise model.data.seq_length (a packed "
                    "sequence holds both sides of a pair) or set packed_sequence false"
                )

    def __len__(self) -> int:
        return self.rows

    def _width(self, position: int) -> int:
        pair = self.stream.pairs[self.stream.pair_index(position)]
        return sum(len(pair.side(rejected)) - 1 for rejected in (False, True))

    def _span(self, row: int) -> tuple[int, int]:
        while len(self._starts) <= row + 1:
            first = end = self._starts[-1]
            used = 0
            while end == first or used + self._width(end) <= self.seq_length:
                used += self._width(end)
                end += 1
            self._starts.append(end)
        return self._starts[row], self._starts[row + 1]

    def __getitem__(self, row: int) -> dict[str, torch.Tensor]:
        first, end = self._span(row % self.rows)
        seq = self.seq_length
        tokens = torch.full((seq,), self.pad_id, dtype=torch.long)
        labels = torch.full((seq,), self.pad_id, dtype=torch.long)
        mask = torch.zeros(seq)
        positions = torch.zeros(seq, dtype=torch.long)
        segment = torch.full((seq,), -1, dtype=torch.long)
        segment_ref = torch.zeros(self.segments)
        segment_real = torch.zeros(self.segments)
        at = number = 0
        for position in range(first, end):
            index = self.stream.pair_index(position)
            pair = self.stream.pairs[index]
            for rejected in (False, True):
                ids = pair.side(rejected)
                width = len(ids) - 1
                span = slice(at, at + width)
                tokens[span] = torch.tensor(ids[:width])
                labels[span] = torch.tensor(ids[1 : width + 1])
                answer = torch.arange(width) >= max(len(pair.prompt) - 1, 0)
                mask[span] = answer.float()
                positions[span] = torch.arange(width)
                segment[span] = number
                segment_ref[number] = float(self.reference[index, int(rejected)])
                segment_real[number] = 1.0
                at, number = at + width, number + 1
        positions[at:] = torch.arange(seq - at)
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        allowed = causal & (segment[:, None] == segment[None, :])
        return {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": mask,
            "position_ids": positions,
            "attention_mask": ~allowed.unsqueeze(0),  # megatron-core: True where masked
            "segment": segment,
            "segment_ref": segment_ref,
            "segment_real": segment_real,
        }


def summary(outputs: list[dict[str, torch.Tensor]], device: str) -> dict[str, float]:
    """The STATS means over every rank's micro-batches (the same on every rank)."""
    values = reduced_sums(outputs, "preference", STATS, device)
    pairs = max(values.pop("pairs"), 1.0)
    return {name: value / pairs for name, value in values.items()}


class DpoTask(PreferenceTask):
    sample_keys = KEYS
    generative = True

    @classmethod
    def sequences_per_example(cls, spec: Any) -> int:
        """Pairs (two sequences each), or, packed, the packed sequences themselves."""
        return 1 if spec.train.section.get("packed_sequence") else 2

    def __init__(self, cfg: Any, spec: Any, base: Any) -> None:
        super().__init__(cfg, spec, base)
        self.settings: DpoSettings = spec.objective
        self.references: dict[str, torch.Tensor] = {}

    # ----- data -------------------------------------------------------------------------

    def sample_maker(self, split: str) -> SampleOf:
        return dpo_sample(self.seq_length, self.tokenizer.eod_id, self.references.get(split))

    def build_data(self, trainer: Trainer) -> Streams:
        """The streams, with the reference's log-probabilities of each split's pairs: computed
        here, with the starting weights (before a resume loads others), or read back."""
        splits = {"train": self.spec.train}
        if self.spec.validation is not None:
            splits["validation"] = self.spec.validation
        if self.spec.test is not None:
            splits["test"] = self.spec.test
        self.pairs = {name: self.read_pairs(trainer, split, name) for name, split in splits.items()}
        self._reference_logps(trainer)
        model = trainer.cfg.model
        samples = self.train_samples(trainer, self.pairs["train"])
        train = data.SampleStream(samples, int(model.micro_batch_size), KEYS)
        if self.spec.train.section.get("packed_sequence"):
            rows = int(trainer.cfg.trainer.max_steps) * int(model.global_batch_size)
            packed = PackedPairs(
                samples, rows, self.seq_length, self.tokenizer.eod_id, self.references["train"]
            )
            train = data.SampleStream(packed, int(model.micro_batch_size), PACKED_KEYS)
        if "validation" not in self.pairs:
            return Streams(train, None, 0)
        valid, batches = self.eval_stream(trainer, self.pairs["validation"], "validation")
        return Streams(train, valid, self.validation_batches(trainer, batches))

    def _fingerprint(self) -> str:
        """What the reference's log-probabilities depend on: the data, the sequence length,
        the reference's weights."""
        reference = self.settings.reference or self.spec.base_model
        parts: list[Any] = [self.seq_length, str(reference), reference.stat().st_size]
        for name, pairs in sorted(self.pairs.items()):
            parts.append([name, [(p.prompt, p.chosen, p.rejected) for p in pairs]])
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    def _reference_logps(self, trainer: Trainer) -> None:
        path = trainer.log_dir / "reference_logps.pt"
        fingerprint = self._fingerprint()
        if path.is_file():
            saved = torch.load(path, weights_only=True)
            if saved.get("fingerprint") == fingerprint:
                self.references = saved["values"]
                trainer.say(f"reference log-probabilities: read back from {path}")
                return
        swapped = self.settings.reference is not None
        if swapped:
            self._load_weights(self.settings.reference, trainer)
        values: dict[str, Any] = {}
        for name, pairs in self.pairs.items():
            stream, batches = self.eval_stream(trainer, pairs, name)
            outputs = trainer.evaluate(stream, batches)
            values[name] = pair_values(trainer, outputs, len(pairs), "pair_logps")
        if swapped:
            self._load_weights(self.spec.base_model, trainer)
        shared = [values]
        dist.broadcast_object_list(shared, src=0)  # rank 0 gathered them
        self.references = {
            name: torch.tensor(rows, dtype=torch.float64) for name, rows in shared[0].items()
        }
        if trainer.rank == 0:
            scratch = path.with_name(path.name + ".tmp")
            torch.save({"fingerprint": fingerprint, "values": self.references}, scratch)
            scratch.replace(path)
        trainer.say(
            "reference log-probabilities of "
            + ", ".join(f"{len(p)} {n} pairs" for n, p in self.pairs.items())
            + f": computed ({path})"
        )

    def _load_weights(self, path: Path, trainer: Trainer) -> None:
        """A portable file's weights into the model's own modules (not the PEFT ones)."""
        weights = portable.read(path, trainer.log_dir, extract=False).tensors  # no tokenizer
        init_weights.load_full_tensors(
            bare_chunks(trainer), weights, wanted=lambda key: not peft.is_peft_key(key)
        )

    def forward_step(self, trainer: Trainer, batch: dict[str, Any], model: Any) -> tuple[Any, Any]:
        mask = batch.get("attention_mask")  # packed rows': block-diagonal; else causal
        output = model(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"])
        return output, partial(preference_loss, self.settings, batch)

    # ----- validation -------------------------------------------------------------------

    def after_validation(self, trainer: Trainer, loss: float, outputs: list[Any]) -> None:
        if math.isnan(loss):
            return
        scores = summary(outputs, trainer.device)
        self.record_validation(
            trainer,
            loss,
            scores,
            f"margin {scores['margin']:.3f}, accuracy {scores['accuracy']:.3f}, rewards chosen "
            f"{scores['rewards_chosen']:.3f} rejected {scores['rewards_rejected']:.3f}",
        )

    # ----- outputs ----------------------------------------------------------------------

    def write_outputs(self, trainer: Trainer) -> None:
        self.write_model(trainer)
        if "test" in self.pairs:
            self._test(trainer, self.pairs["test"])
        if trainer.rank == 0 and trainer.metrics_log is not None:
            plotted = plot_curves(trainer.metrics_log.path, trainer.log_dir / "dpo_curves.png")
            if plotted:
                trainer.say(f"DPO curves: {trainer.log_dir / 'dpo_curves.png'}")
        dist.barrier()

    def _test(self, trainer: Trainer, pairs: list[Pair]) -> None:
        """The test pairs' metrics (test_metrics.json, with the mean loss), and each pair's
        tokens with the policy's and the reference's log-probabilities (test_logps.jsonl)."""
        stream, batches = self.eval_stream(trainer, pairs, "test")
        outputs = trainer.evaluate(stream, batches)
        scores = summary(outputs, trainer.device)
        scores["loss"] = mean_loss(outputs, trainer.device)
        policy = pair_values(trainer, outputs, len(pairs), "pair_logps")
        if policy is None:
            return
        reference = self.references["test"].tolist()
        rows = [
            {
                "source": pair.where,
                "prompt_ids": pair.prompt,
                "chosen_ids": pair.chosen,
                "rejected_ids": pair.rejected,
                "policy": mine,
                "reference": theirs,
            }
            for pair, mine, theirs in zip(pairs, policy, reference, strict=True)
        ]
        write_atomic(
            trainer.log_dir / "test_logps.jsonl", "".join(json.dumps(r) + "\n" for r in rows)
        )
        path = trainer.log_dir / "test_metrics.json"
        write_atomic(path, json.dumps(scores, indent=2) + "\n")
        trainer.say(f"test set: margin {scores['margin']:.3f} over {len(pairs)} pairs; {path}")


def plot_curves(metrics_file: Path, output: Path) -> bool:
    """The validation margin, accuracy and rewards against the step; False with fewer than
    two validations."""
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    rows = [row for row in rows if "validation_margin" in row]
    if len(rows) < 2:
        return False
    # A Figure of its own draws to the file without pyplot.
    from matplotlib.figure import Figure

    steps = [row["step"] for row in rows]
    figure = Figure(figsize=(11, 4))
    left, right = figure.subplots(1, 2)
    for name in ("rewards_chosen", "rewards_rejected", "margin"):
        left.plot(steps, [row[f"validation_{name}"] for row in rows], marker="o", label=name)
    left.set_xlabel("step")
    left.set_title("implicit rewards (beta x log ratio)")
    left.legend()
    right.plot(steps, [row["validation_accuracy"] for row in rows], marker="o", color="C3")
    right.set_ylim(0, 1.02)
    right.set_xlabel("step")
    right.set_title("pairs ranked right")
    metrics.save_figure(figure, output)
    return True
