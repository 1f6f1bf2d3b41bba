"""An encoder-decoder (T5, mT5) as the generation engine sees a model: full-sequence logits.

The engine continues rows of token ids (`generation.generate`). For an encoder-decoder a row is
the prompt's encoder ids, then the decoder's start id, then what has been generated: the
runner splits each row at its first start id (no text encodes to it), runs the encoder on the
part before and the decoder on the rest, and returns the decoder's logits at the row's own
positions. Greedy decoding, sampling, beam search, stop words and streaming then work as they
do for GPT, at any TP/PP, with every rank computing the same logits.

`logits` runs whole rows (scoring); `cache` opens the KV cache generation uses
(seq2seq_cache.py: the encoder once per sequence, the decoder a token a step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from launcher_scripts.jobs.models.t5_masks import attention_masks


@dataclass
class Seq2SeqRunner:
    chunks: list[Any]  # this rank's unwrapped T5Model stages
    start_id: int  # the decoder's first input, which ends a row's encoder part
    vocab_size: int  # the tokenizer's; the model's padded rows are dropped
    tensor: int
    pipeline: int
    sequence_parallel: bool
    on_gpu: bool
    pad_id: int = 0  # fills the rows past their ends (masked out by their lengths)

    def cache(self, slots: int, positions: int) -> Any:
        """A cache of `slots` sequences of rows up to `positions` tokens."""
        # With sequence parallelism (a training model generating during validation) the
        # blocks split the sequence over the TP ranks, which a step's one new token cannot be.
        if self.sequence_parallel:
            from launcher_scripts.jobs.inference.generation import Recomputing

            return Recomputing(self.logits).cache(slots, positions)
        from launcher_scripts.jobs.inference.seq2seq_cache import Seq2SeqCache

        return Seq2SeqCache(self, slots, positions)

    def cache_bytes_per_slot(self, positions: int) -> int:
        """What `cache(slots, positions)` allocates per slot on this rank: the decoder's keys
        and values, and the encoder's output, on the stage holding the decoder (nothing on an
        encoder stage of a pipeline, nor when it recomputes)."""
        chunk = self.chunks[0]
        if self.sequence_parallel or not chunk.add_decoder:
            return 0
        from launcher_scripts.jobs.inference.kv_cache import bytes_per_slot
        from launcher_scripts.jobs.inference.seq2seq_cache import encoder_bytes_per_slot

        decoder = min(positions, int(chunk.max_sequence_length))
        return bytes_per_slot(self, decoder) + encoder_bytes_per_slot(chunk)

    @property
    def cached_stacks(self) -> list[Any]:
        """The layers a KV cache keeps keys and values of: the decoder's."""
        return [chunk.decoder for chunk in self.chunks if chunk.add_decoder]

    @contextlib.contextmanager
    def inference(self) -> Iterator[None]:
        with torch.inference_mode(), self._device_mode():
            yield

    def to_device(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.cuda() for t in tensors) if self.on_gpu else tensors

    @torch.no_grad()
    def logits(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """[rows, longest row, vocab_size] float32 on the CPU: position i of a row's decoder
        part holds the logits of the token after it; encoder positions hold zeros."""
        splits = []
        for index, row in enumerate(rows):
            if self.start_id not in row[1:]:
                raise ValueError(
                    f"row {index} has no encoder ids followed by the decoder start id "
                    f"{self.start_id}"
                )
            splits.append(list(row).index(self.start_id, 1))
        multiple = self.tensor if self.sequence_parallel else 1
        encoder_width = _round_up(max(splits), multiple)
        decoder_width = _round_up(
            max(len(r) - s for r, s in zip(rows, splits, strict=True)), multiple
        )
        encoder = torch.full((len(rows), encoder_width), self.pad_id, dtype=torch.long)
        decoder = torch.full((len(rows), decoder_width), self.pad_id, dtype=torch.long)
        encoder_valid = torch.zeros(encoder.shape, dtype=torch.bool)
        decoder_valid = torch.zeros(decoder.shape, dtype=torch.bool)
        for index, (row, split) in enumerate(zip(rows, splits, strict=True)):
            encoder[index, :split] = torch.tensor(row[:split])
            decoder[index, : len(row) - split] = torch.tensor(row[split:])
            encoder_valid[index, :split] = True
            decoder_valid[index, : len(row) - split] = True
        masks = attention_masks(encoder_valid, decoder_valid)
        with self._device_mode():
            if self.on_gpu:
                encoder, decoder = encoder.cuda(), decoder.cuda()
                masks = tuple(mask.cuda() for mask in masks)
            if self.pipeline == 1:
                output = self.gather_vocab(self._forward(self.chunks[0], encoder, decoder, masks))
            else:
                output = self._pipelined(encoder, decoder, masks)
        decoded = output[..., : self.vocab_size].float().cpu()
        result = torch.zeros(len(rows), max(len(r) for r in rows), self.vocab_size)
        for index, (row, split) in enumerate(zip(rows, splits, strict=True)):
            result[index, split : len(row)] = decoded[index, : len(row) - split]
        return result

    def encoded(self, tokens: torch.Tensor, masks: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        """The encoder's output [width, rows, hidden] over [rows, width] encoder ids (its final
        norm applied), on the stage holding the decoder; None on a pipeline's encoder stages,
        whose hidden states pass on through megatron-core's schedule as in `logits`. `masks`
        as `attention_masks` makes them (the decoder's are not read). Run under `inference`."""
        tokens, *masks = self.to_device(tokens, *masks)
        starts = tokens[:, :1]  # the decoder is not run
        if self.pipeline == 1:
            return self.chunks[0](tokens, starts, *masks, output_encoder_hidden_only=True)
        from megatron.core import parallel_state

        outputs = self._schedule(
            partial(self._encoder_step, tokens, starts, tuple(masks)), *tokens.shape
        )
        return outputs[0]["encoded"] if parallel_state.is_pipeline_last_stage() else None

    @staticmethod
    def _encoder_step(
        tokens: torch.Tensor,
        starts: torch.Tensor,
        masks: tuple[torch.Tensor, ...],
        _iterator: Any,
        model: Any,
    ) -> tuple[Any, Any]:
        received = None if model.add_encoder else model.encoder_hidden_state
        output = model(
            tokens, starts, *masks, encoder_hidden_states=received, output_encoder_hidden_only=True
        )
        return output, _keep_encoded

    def _schedule(self, forward_step: Any, rows: int, encoder_width: int) -> Any:
        """One forward-only micro-batch through megatron-core's pipeline schedule, which hands
        the encoder's hidden states [encoder_width, rows, hidden] from stage to stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([None]),
            model=self.chunks,
            num_microbatches=1,
            seq_length=encoder_width,
            micro_batch_size=rows,
            forward_only=True,
        )

    @staticmethod
    def _forward(
        chunk: Any, encoder: torch.Tensor, decoder: torch.Tensor, masks: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        # A pipeline's decoder stage holds no encoder: it gets the encoder's output passed on.
        received = None if chunk.add_encoder else chunk.encoder_hidden_state
        return chunk(encoder, decoder, *masks, encoder_hidden_states=received)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if self.tensor == 1:
            return logits
        from megatron.core import tensor_parallel

        return tensor_parallel.gather_from_tensor_model_parallel_region(logits)

    def _pipelined(
        self, encoder: torch.Tensor, decoder: torch.Tensor, masks: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        """One forward-only micro-batch through megatron-core's schedule (the encoder's output
        is what passes between stages); the last stage's logits are then broadcast."""
        from megatron.core import parallel_state

        rows, width = decoder.shape
        step = partial(self._forward_step, encoder, decoder, masks)
        outputs = self._schedule(step, rows, encoder.shape[1])
        last = parallel_state.is_pipeline_last_stage()
        shape = (rows, width, self.chunks[0].vocab_size)
        return self.from_last_stage(outputs[0]["logits"].contiguous() if last else None, shape)

    def from_last_stage(self, logits: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
        """The pipeline's last stage's logits (of `shape`; None on the other stages), on every
        stage."""
        from megatron.core import parallel_state

        if logits is None:
            chunk = self.chunks[0]
            device = torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else "cpu"
            dtype = next(chunk.parameters()).dtype
            logits = torch.empty(shape, device=device, dtype=dtype)
        dist.broadcast(
            logits,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        return logits

    def _forward_step(
        self,
        encoder: torch.Tensor,
        decoder: torch.Tensor,
        masks: tuple[torch.Tensor, ...],
        _iterator: Any,
        model: Any,
    ) -> tuple[Any, Any]:
        return self._forward(model, encoder, decoder, masks), self._keep_logits

    def _keep_logits(self, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # The schedule expects (loss, reduced dict); the "loss" is unused in forward-only mode.
        return output.new_zeros(()), {"logits": self.gather_vocab(output)}

    def _device_mode(self) -> contextlib.AbstractContextManager[Any]:
        """megatron-core makes "cuda" helper tensors; on the CPU they are redirected."""
        if self.on_gpu:
            return contextlib.nullcontext()
        from launcher_scripts.jobs.training.cpu_compat import CudaDevicesOnCpu

        return CudaDevicesOnCpu()


def _keep_encoded(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    # The schedule expects (loss, reduced dict); the "loss" is unused in forward-only mode.
    return output.new_zeros(()), {"encoded": output}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
