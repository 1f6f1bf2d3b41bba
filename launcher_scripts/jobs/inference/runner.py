"""A trained model ready for inference: built from a portable file at a TP/PP layout, answering
batched next-token logits, the same on every rank.

Every rank of a TP/PP group calls `ModelRunner.logits` with the same batch (it is a collective);
the full-vocabulary logits are gathered over TP and sent from the last pipeline stage to the
others, so callers (generation, lm-eval) run identical code on every rank and agree on every
token they pick.

`logits` runs whole rows (scoring); `cache` opens a KV cache for generation (kv_cache.py).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from launcher_scripts.jobs.inference.memory import ForwardShape
from launcher_scripts.jobs.inference.text_tokenizer import TextTokenizer, load_text_tokenizer


class InferenceError(Exception):
    """A model file or layout that cannot be served, as one line for the user."""


@dataclass
class ModelRunner:
    chunks: list[Any]
    tokenizer: TextTokenizer
    max_length: int  # positions the model has
    vocab_size: int  # the tokenizer's; the model's padded rows are dropped
    tensor: int
    pipeline: int
    on_gpu: bool
    # A reward model's: one value per position (vocab_size 1), whole on every TP rank.
    scalar: bool = False

    @torch.no_grad()
    def logits(self, batch: Sequence[Sequence[int]]) -> torch.Tensor:
        """[rows, longest row, vocab_size] float32 logits on the CPU; shorter rows are padded
        on the right with the EOD id (their padded positions hold nothing meaningful). One
        forward pass over whole rows: what scoring needs; generation uses a KV cache
        (`cache`)."""
        if not batch or not all(batch):
            raise ValueError("every row of a batch needs at least one token")
        width = max(len(row) for row in batch)
        if width > self.max_length:
            raise ValueError(f"a row of {width} tokens exceeds the model's {self.max_length}")
        tokens = torch.full((len(batch), width), self.tokenizer.eod_id, dtype=torch.long)
        for index, row in enumerate(batch):
            tokens[index, : len(row)] = torch.tensor(row, dtype=torch.long)
        causal = torch.ones(width, width, dtype=torch.bool).triu(diagonal=1)
        return self.forward(tokens, _positions(tokens), causal[None, None])

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        context: Any = None,
    ) -> torch.Tensor:
        """The model over [rows, width] tokens at their positions, as float32 CPU logits over
        the tokenizer's vocabulary: [rows, width, vocab_size], or [rows, 1, vocab_size] with a
        megatron-core inference context (which keeps only the last position's). `mask`: True
        where a query must not see a key, [rows or 1, 1, width, keys]. Under inference mode,
        not only no_grad: torch then skips version counting and view tracking, about 14% of a
        small model's decoding step."""
        with torch.inference_mode(), self._device_mode(pipelined=self.pipeline > 1):
            if self.on_gpu:
                tokens, positions = tokens.cuda(), positions.cuda()
                mask = mask.cuda()
            step = partial(_call, tokens, positions, mask, context)
            # megatron-core gathers the TP shards of the logits itself in inference mode.
            gather = context is None
            if self.pipeline == 1:
                output = step(self.chunks[0])
                output = self._gather_vocab(output) if gather else output
            else:
                width = tokens.shape[1] if gather else 1
                output = self._pipelined(step, gather, tokens.shape[0], tokens.shape[1], width)
        return output[..., : self.vocab_size].float().cpu()

    def cache(self, slots: int, positions: int) -> Any:
        """A KV cache of `slots` sequences of up to `positions` tokens (kv_cache.py)."""
        from launcher_scripts.jobs.inference.kv_cache import KVCache

        return KVCache(self, slots, positions)

    def cache_bytes_per_slot(self, positions: int) -> int:
        """What `cache(slots, positions)` allocates per slot on this rank."""
        from launcher_scripts.jobs.inference.kv_cache import bytes_per_slot

        return bytes_per_slot(self, positions)

    def _gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if self.tensor == 1 or self.scalar:
            return logits
        from megatron.core import tensor_parallel

        return tensor_parallel.gather_from_tensor_model_parallel_region(logits)

    def _pipelined(
        self,
        step: Callable[[Any], torch.Tensor],
        gather: bool,
        rows: int,
        width: int,
        out_width: int,
    ) -> torch.Tensor:
        """One forward-only micro-batch through megatron-core's pipeline schedule; the last
        stage's logits ([rows, out_width, vocab]) are then broadcast to the other stages."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        outputs = get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, step, gather),
            data_iterator=iter([None]),
            model=self.chunks,
            num_microbatches=1,
            seq_length=width,
            micro_batch_size=rows,
            forward_only=True,
        )
        vocab = self._padded_vocab()
        if parallel_state.is_pipeline_last_stage():
            logits = outputs[0]["logits"].contiguous()
        else:
            device = torch.cuda.current_device() if self.on_gpu else "cpu"
            logits = torch.empty(rows, out_width, vocab, device=device, dtype=self._dtype())
        dist.broadcast(
            logits,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        return logits

    def _forward_step(
        self, step: Callable[[Any], torch.Tensor], gather: bool, _iterator: Any, model: Any
    ) -> tuple[Any, Any]:
        return step(model), partial(self._keep_logits, gather)

    def _keep_logits(
        self, gather: bool, output: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # The schedule expects (loss, reduced dict); the "loss" is unused in forward-only mode.
        return output.new_zeros(()), {"logits": self._gather_vocab(output) if gather else output}

    def forward_shape(self) -> ForwardShape:
        """What this rank's `logits` call allocates per position depends on (see memory.py)."""
        from launcher_scripts.jobs.inference.served import forward_shape

        return forward_shape(self.chunks[0], self.tensor, self.vocab_size, self.on_gpu)

    def _padded_vocab(self) -> int:
        return 1 if self.scalar else int(self.chunks[0].vocab_size)

    def _dtype(self) -> torch.dtype:
        return next(self.chunks[0].parameters()).dtype

    def _device_mode(self, pipelined: bool = True) -> contextlib.AbstractContextManager[Any]:
        """megatron-core makes "cuda" helper tensors in the pipeline schedule; on CPU they are
        redirected. Entered per call because the mode is thread-local (servers call from worker
        threads). A model called directly (no pipeline) makes none, and the mode costs every
        torch call a Python hop: a decoding step of a small model makes thousands."""
        if self.on_gpu or not pipelined:
            return contextlib.nullcontext()
        from launcher_scripts.jobs.training.cpu_compat import CudaDevicesOnCpu

        return CudaDevicesOnCpu()


def _call(
    tokens: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    context: Any,
    chunk: Any,
) -> torch.Tensor:
    if context is None:
        return chunk(tokens, positions, mask)
    return chunk(tokens, positions, mask, inference_context=context, runtime_gather_output=True)


def _positions(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


@dataclass
class OpenedModel:
    """A portable file's model built on this rank of a TP x PP group."""

    chunks: list[Any]
    config: Any  # the file's model section (tokenizer paths made absolute)
    tensor: int
    pipeline: int
    on_gpu: bool


def open_model(
    model_file: Path,
    tensor: int = 1,
    pipeline: int = 1,
    on_gpu: bool | None = None,
    expert: int = 1,
) -> OpenedModel:
    """Join the job's processes (torchrun, srun, or this process alone), set up megatron-core's
    TP/PP groups (and EP's: a mixture of experts' experts split over `expert` ranks, each
    running the same inputs) and build the model from the portable file, whatever its family.
    Every rank must call it."""
    from megatron.core import parallel_state

    from launcher_scripts.formats import portable
    from launcher_scripts.jobs.conversion import load
    from launcher_scripts.jobs.training import cpu_compat, runtime

    if on_gpu is None:
        on_gpu = torch.cuda.is_available()
    model_file = Path(model_file)
    if not model_file.is_file():
        raise InferenceError(f"model file {model_file} does not exist: run the conversion first")
    info = runtime.process_info()
    if info.world_size != tensor * pipeline * expert:
        raise InferenceError(
            f"{info.world_size} processes were started for TP={tensor} x PP={pipeline} x "
            f"EP={expert}: start {tensor * pipeline * expert} (one per model-parallel rank)"
        )
    if not on_gpu:
        cpu_compat.patch_cuda_queries()
    if not dist.is_initialized():
        if info.world_size == 1:
            # No port and no environment changes: a server starts several of these processes
            # side by side (under srun too), and children of this one may start their own.
            backend = "nccl" if on_gpu else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            runtime.init_distributed(info, on_gpu, rendezvous_timeout=600)
    with contextlib.ExitStack() as stack:
        if not on_gpu:
            stack.enter_context(cpu_compat.CudaDevicesOnCpu())
        parallel_state.initialize_model_parallel(
            tensor, pipeline, expert_model_parallel_size=expert
        )
        if on_gpu:
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(1234)
        else:
            cpu_compat.install()
            cpu_compat.seed_model_parallel_rngs(1234)
        # Tokenizer files are extracted here; the processes keep them open only while loading.
        workdir = Path(tempfile.mkdtemp(prefix="model-"))
        loaded = portable.read(model_file, workdir)
        _check_layout(loaded.config, tensor, pipeline)
        chunks = load.build(loaded, tensor, pipeline, on_gpu, expert=expert)
    return OpenedModel(chunks, loaded.config, tensor, pipeline, on_gpu)


def open_runner(
    model_file: Path,
    tensor: int = 1,
    pipeline: int = 1,
    on_gpu: bool | None = None,
    expert: int = 1,
) -> ModelRunner:
    """A decoder stack's runner (open_model, then its text tokenizer)."""
    return runner_of(open_model(model_file, tensor, pipeline, on_gpu, expert))


def inference_only(chunks: list[Any]) -> None:
    """Put inference's fast paths in a model opened for inference only (a served or evaluated
    model; a model being trained must not take them): fused attention, plain linear layers and
    transformer layers, keys rotated once as they enter the cache."""
    from launcher_scripts.jobs.inference.fused_attention import fuse_local_attention
    from launcher_scripts.jobs.inference.lean_layer import lean_layers
    from launcher_scripts.jobs.inference.lean_linear import lean_linears
    from launcher_scripts.jobs.inference.rope_at_append import rotate_keys_at_append

    fuse_local_attention(chunks)
    lean_linears(chunks)
    lean_layers(chunks)
    rotate_keys_at_append(chunks)


def runner_of(opened: OpenedModel) -> ModelRunner:
    inference_only(opened.chunks)
    model = opened.config
    tokenizer = load_text_tokenizer(model.tokenizer)
    return ModelRunner(
        chunks=opened.chunks,
        tokenizer=tokenizer,
        max_length=int(model.max_position_embeddings),
        vocab_size=tokenizer.vocab_size,
        tensor=opened.tensor,
        pipeline=opened.pipeline,
        on_gpu=opened.on_gpu,
    )


def _check_layout(model: Any, tensor: int, pipeline: int) -> None:
    from launcher_scripts.config.checks import require_layout
    from launcher_scripts.errors import ConfigError

    try:
        require_layout(model, tensor, pipeline, "model")
    except ConfigError as error:
        raise InferenceError(f"TP={tensor} x PP={pipeline}: {error.problem}") from None


def close_runner() -> None:
    from launcher_scripts.jobs.training import runtime

    runtime.shutdown()


@contextlib.contextmanager
def running(model_file: Path, tensor: int = 1, pipeline: int = 1) -> Iterator[ModelRunner]:
    runner = open_runner(model_file, tensor, pipeline)
    try:
        yield runner
    finally:
        close_runner()
