"""A KV cache for an encoder-decoder (T5, mT5): the encoder runs once per sequence, the decoder
one token per step.

A sequence arrives as one row, its encoder ids then the decoder's start id (seq2seq.py). `add`
runs the encoder over the new rows and keeps its output in the sequences' slots; then the
decoder part goes through kv_cache.KVCache's layout (slots, the shared frontier, joins,
forks, drops and compaction), whose forward here is megatron-core's own modules called one
by one with the static inference context: the embedding at each token's own decoder position,
the decoder block over the cache, the LM head. The encoder's output slots follow the cache's
slot moves.

Why the model's own forward (T5Model.forward) is not called: it numbers decoder positions
from 0 in every call and computes the relative bias for a square of the new tokens only, so a
step would see its one token at position 0. And cross-attention runs without the context:
megatron-core's static context keys its buffers by layer number, which a decoder layer's self-
and cross-attention share, and a cross-attention's keys are the encoder's, not the decoder's
positions; they are computed from the kept encoder output at each step instead.

Under pipeline parallelism the encoder runs on the first stages and the whole decoder on the
last (models/t5.py): `add` runs the encoder through megatron-core's schedule, which hands its
hidden states from stage to stage, and the last stage keeps the output in its slots; the
decoder's steps then run on the last stage alone, which sends each step's logits to the other
stages. The encoder stages keep the cache's bookkeeping (slots, frontier) and no buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

from launcher_scripts.jobs.inference.kv_cache import CacheFull, KVCache
from launcher_scripts.jobs.models.t5_masks import attention_masks


def _without_context(_module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A cross-attention's forward pre-hook: no inference context (see the module's doc)."""
    kwargs = dict(kwargs)
    for name in ("inference_context", "inference_params"):
        if name in kwargs:
            kwargs[name] = None
    return args, kwargs


def uncached_cross_attention(chunk: Any) -> None:
    """Run the decoder's cross-attention layers without the inference context (once per model)."""
    from megatron.core.transformer.attention import CrossAttention

    if getattr(chunk, "_cross_attention_uncached", False):
        return
    for module in chunk.decoder.modules():
        if isinstance(module, CrossAttention):
            module.register_forward_pre_hook(_without_context, with_kwargs=True)
    chunk._cross_attention_uncached = True


def encoder_bytes_per_slot(chunk: Any) -> int:
    """The encoder output one slot keeps: every encoder position's hidden state."""
    dtype = next(chunk.parameters()).dtype
    return int(chunk.max_sequence_length) * chunk.config.hidden_size * dtype.itemsize


class Seq2SeqCache(KVCache):
    def __init__(self, runner: Any, slots: int, positions: int) -> None:
        chunk = runner.chunks[0]
        self.model = runner
        self.chunk = chunk
        self.encoder_positions = int(chunk.max_sequence_length)
        device = torch.device("cuda", torch.cuda.current_device()) if runner.on_gpu else "cpu"
        dtype = next(chunk.parameters()).dtype
        # Kept by the stage that decodes (the only one at PP=1, the last under a pipeline).
        kept = self.encoder_positions if chunk.add_decoder else 0
        hidden = chunk.config.hidden_size
        self.encoded = torch.zeros(kept, slots, hidden, dtype=dtype, device=device)
        self.encoded_valid = torch.zeros(slots, self.encoder_positions, dtype=torch.bool)
        if chunk.add_decoder:
            uncached_cross_attention(chunk)
        # The decoder's positions: a row's encoder part is not in this cache.
        side = _DecoderSide(self, runner.pad_id, runner.cached_stacks, runner.on_gpu)
        super().__init__(side, slots, min(positions, self.encoder_positions))

    @property
    def bytes(self) -> int:
        return super().bytes + self.encoded.nbytes

    def add(self, prompts: Sequence[Sequence[int]]) -> tuple[list[int], torch.Tensor]:
        start = self.model.start_id
        parts = []
        for index, row in enumerate(prompts):
            if start not in list(row)[1:]:
                raise ValueError(
                    f"row {index} has no encoder ids followed by the decoder start id {start}"
                )
            split = list(row).index(start, 1)
            if split > self.encoder_positions:
                raise CacheFull(f"an encoder part of {split} tokens; {self.encoder_positions}")
            parts.append((list(row)[:split], list(row)[split:]))
        if len(self.live) + len(parts) > self.slots:
            raise CacheFull(f"{len(self.live)} + {len(parts)} sequences; {self.slots} slots")
        first = len(self.live)
        self._encode([encoder for encoder, _ in parts], first)
        return super().add([decoder for _, decoder in parts])

    def _encode(self, rows: list[list[int]], first: int) -> None:
        """The encoder over `rows`, its output kept in slots first, first + 1, ..."""
        width = max(len(row) for row in rows)
        tokens = torch.full((len(rows), width), self.model.pad_id, dtype=torch.long)
        valid = torch.zeros(len(rows), width, dtype=torch.bool)
        for index, row in enumerate(rows):
            tokens[index, : len(row)] = torch.tensor(row, dtype=torch.long)
            valid[index, : len(row)] = True
        with self.model.inference():
            output = self.model.encoded(tokens, attention_masks(valid, valid[:, :1]))
        if output is not None:
            self.encoded[:width, first : first + len(rows)] = output
            self.encoded[width:, first : first + len(rows)] = 0
        self.encoded_valid[first : first + len(rows)] = False
        self.encoded_valid[first : first + len(rows), :width] = valid

    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, context: Any
    ) -> torch.Tensor:
        """The decoder over [rows, width] new tokens of the slots from the context's batch
        offset: next-token logits [rows, 1, vocab] of the last column, on every stage."""
        chunk = self.chunk
        first, rows, width = context.batch_size_offset, tokens.shape[0], tokens.shape[1]
        if not chunk.add_decoder:  # an encoder stage: the last stage's logits
            with self.model.inference():
                logits = self.model.from_last_stage(None, (rows, 1, chunk.vocab_size))
            return logits[..., : self.model.vocab_size].float().cpu()
        keys = mask.shape[-1]
        encoded_width = int(self.encoded_valid[first : first + rows].sum(dim=1).max())
        cross = ~self.encoded_valid[first : first + rows, None, None, :encoded_width]
        with self.model.inference():
            tokens, positions, mask, cross = self.model.to_device(tokens, positions, mask, cross)
            hidden = chunk.embedding(input_ids=tokens, position_ids=positions)
            bias = self._relative_bias(chunk.decoder_relative_pos_emb, keys - width, width, keys)
            hidden = chunk.decoder(
                hidden_states=hidden,
                attention_mask=mask,
                context=self.encoded[:encoded_width, first : first + rows],
                context_mask=cross,
                inference_context=context,
                attention_bias=bias,
            )
            weight = chunk.shared_embedding_or_output_weight()
            weight = weight if chunk.share_embeddings_and_output_weights else None
            logits = chunk.lm_head(hidden[-1:], word_embeddings_weight=weight)
            logits = self.model.gather_vocab(logits).transpose(0, 1)
            if self.model.pipeline > 1:
                logits = self.model.from_last_stage(logits.contiguous(), tuple(logits.shape))
        return logits[..., : self.model.vocab_size].float().cpu()

    def _relative_bias(self, table: Any, offset: int, queries: int, keys: int) -> Any:
        """T5's relative position bias of queries at cache positions [offset, offset +
        queries) over keys [0, keys), this rank's heads: [1, heads, queries, keys]; None for
        learned absolute positions. It depends only on the distances, so cache positions stand
        in for a sequence's own."""
        if table is None or self.chunk.position_embedding_type != "relative":
            return None
        from megatron.core.tensor_parallel import scatter_to_tensor_model_parallel_region

        bias = table(offset + queries, keys)[:, :, offset:]
        if self.model.tensor == 1:
            return bias
        spread = scatter_to_tensor_model_parallel_region(bias.permute(0, 2, 3, 1))
        return spread.permute(0, 3, 1, 2)

    def _copy_slot(self, source: int, target: int) -> None:
        super()._copy_slot(source, target)
        self.encoded[:, target] = self.encoded[:, source]
        self.encoded_valid[target] = self.encoded_valid[source]


class _DecoderSide(SimpleNamespace):
    """What KVCache asks of its model: the decoder's layers to cache, its padding id, and a
    forward over new tokens (the cache's decode)."""

    def __init__(self, cache: Seq2SeqCache, pad_id: int, stacks: list[Any], on_gpu: bool):
        super().__init__(
            chunks=stacks, tokenizer=SimpleNamespace(eod_id=pad_id), on_gpu=on_gpu, cache=cache
        )

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, context: Any
    ) -> torch.Tensor:
        return self.cache.decode(tokens, positions, mask, context)
