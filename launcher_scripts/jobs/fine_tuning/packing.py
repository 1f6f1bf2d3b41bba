"""Sequence packing: several SFT samples in one sequence of `seq_length` positions, so that
short samples do not spend most of a step on padding.

Samples are taken in the order of the mixed training stream and added to the current sequence
while they fit. Each keeps its own positions (restarting at 0), its own loss mask, and sees only
itself: the attention mask is block-diagonal and causal, so a packed step computes exactly the
losses the samples would give one by one. The packing is a pure function of the stream, the
same on every rank and after a resume.
"""

from __future__ import annotations

import torch

from launcher_scripts.jobs.fine_tuning.sft_data import MixedSamples


class PackedSamples:
    def __init__(self, stream: MixedSamples, total: int, seq_length: int, pad_id: int) -> None:
        self.stream, self.total = stream, total
        self.seq_length, self.pad_id = seq_length, pad_id
        self._starts = [0]  # first stream sample of each pack computed so far, and the next

    def __len__(self) -> int:
        return self.total

    def _span(self, index: int) -> tuple[int, int]:
        while len(self._starts) <= index + 1:
            first = self._starts[-1]
            used, end = 0, first
            while True:
                width = len(self.stream.encoded(end).ids) - 1
                if end > first and used + width > self.seq_length:
                    break
                used += width
                end += 1
            self._starts.append(end)
        return self._starts[index], self._starts[index + 1]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        first, end = self._span(index % self.total)
        seq = self.seq_length
        tokens = torch.full((seq,), self.pad_id, dtype=torch.long)
        labels = torch.full((seq,), self.pad_id, dtype=torch.long)
        loss_mask = torch.zeros(seq)
        positions = torch.zeros(seq, dtype=torch.long)
        segment = torch.full((seq,), -1, dtype=torch.long)  # padding: its own segment
        at = 0
        for number, sample in enumerate(range(first, end)):
            encoded = self.stream.encoded(sample)
            width = min(len(encoded.ids) - 1, seq - at)
            span = slice(at, at + width)
            tokens[span] = torch.tensor(encoded.ids[:width])
            labels[span] = torch.tensor(encoded.ids[1 : width + 1])
            loss_mask[span] = torch.tensor(encoded.loss[1 : width + 1], dtype=torch.float)
            positions[span] = torch.arange(width)
            segment[span] = number
            at += width
        positions[at:] = torch.arange(seq - at)
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        allowed = causal & (segment[:, None] == segment[None, :])
        return {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": loss_mask,
            "position_ids": positions,
            "attention_mask": ~allowed.unsqueeze(0),  # megatron-core: True where masked
        }
