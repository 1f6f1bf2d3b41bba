"""Two megatron-core internals assume CUDA; on a CPU run they are swapped for CPU versions.

- The global memory buffer (used by sequence-parallel all-gathers) allocates on
  `torch.cuda.current_device()` and is reused between collectives.
- The RNG tracker that gives tensor-parallel ranks their own dropout streams saves and restores
  CUDA generator states. On CPU the same streams are kept with the CPU generator.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.transformer.moe import token_dispatcher
from megatron.core.utils import GlobalMemoryBuffer


class CpuMemoryBuffer(GlobalMemoryBuffer):
    """Fresh CPU tensors instead of one reused CUDA buffer.

    On a GPU the reuse is safe because kernels and collectives are ordered on streams. On the
    CPU, gloo's asynchronous collectives run on their own threads, and reusing the buffer let
    a sequence-parallel all-gather overwrite data still in use (seen as run-to-run loss
    differences). CPU allocations are cheap, so nothing is reused.
    """

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):  # type: ignore[override]
        return torch.empty(tuple(tensor_shape), dtype=dtype, device="cpu", requires_grad=False)


class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
    """Named CPU generator states, forked the way the CUDA tracker forks CUDA states."""

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)
        self._is_initialized = True

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)
        self._is_initialized = True

    @contextlib.contextmanager
    def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def install() -> None:
    """Call after `parallel_state.initialize_model_parallel` on a CPU-only run."""
    parallel_state._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()
    mcore_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    token_dispatcher.maybe_move_tensor_to_cpu = host_copy


def host_copy(tensor: object, as_numpy: bool = False, record_stream: bool = False) -> object:
    """megatron-core's maybe_move_tensor_to_cpu for tensors already on the CPU. Its own
    returns a CPU tensor unchanged even when asked for a numpy array, and the all-to-all token
    dispatcher passes the result to all_to_all_single as split sizes, which must be a sequence
    of ints (a numpy array is, as on a GPU run)."""
    del record_stream
    if as_numpy and isinstance(tensor, torch.Tensor):
        return tensor.numpy()
    return tensor


def seed_model_parallel_rngs(seed: int) -> None:
    """What `model_parallel_cuda_manual_seed` does, on the CPU generator."""
    tracker = mcore_random._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    torch.manual_seed(seed)
    tracker.add(mcore_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    expert_seed = seed + 1024 + 100 * parallel_state.get_expert_model_parallel_rank()
    tracker.add(mcore_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, expert_seed)


class CudaDevicesOnCpu(torch.overrides.TorchFunctionMode):
    """Runs tensors megatron-core places on "cuda" on the CPU instead.

    Its schedules, gradient buffers and pipeline communication create helper tensors with
    `device="cuda"` or `torch.cuda.current_device()`; on a CPU-only run those are redirected.
    Its optimizers also check parameter types by name ("torch.cuda.FloatTensor"): CPU tensors
    answer with the CUDA name of the same dtype.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        device = kwargs.get("device")
        if device is not None and _is_cuda(device):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and args[1:] and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _is_cuda(device: object) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _no_op(*_args: object, **_kwargs: object) -> None:
    return None


class CpuEvent:
    """A CUDA event's stand-in: CPU work is done when the call that queued it returns."""

    def synchronize(self) -> None:
        return None


class CpuStream:
    """A CUDA stream's stand-in. megatron-core's all-to-all token dispatcher copies the routing
    counts to the host on a side stream of its own and waits on an event of it; on the CPU
    there is nothing to overlap, so waiting and recording are immediate."""

    def __init__(self, *_args: object, **_kwargs: object) -> None:
        pass

    def wait_stream(self, _other: object) -> None:
        return None

    def record_event(self, _event: object = None) -> CpuEvent:
        return CpuEvent()


_DEFAULT_STREAM = CpuStream()


def patch_cuda_queries() -> None:
    """The few `torch.cuda` calls megatron-core makes unconditionally, answered for the CPU.

    `current_device()` mostly feeds `device=` arguments. It answers the CPU device rather than
    an index because the mode above is thread-local, and backward passes of megatron-core's
    autograd functions may run on autograd's own threads, where only this answer reaches.
    Streams: see CpuStream.
    """
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = _no_op  # type: ignore[assignment]
    torch.cuda.Stream = CpuStream  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda *_args, **_kwargs: _DEFAULT_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda *_args, **_kwargs: contextlib.nullcontext()  # type: ignore[assignment]
