"""What a server's generation costs in memory, and what it may use here, so a model server
refuses, when it starts, a number of slots it cannot hold instead of growing until the kernel
kills it (model_server.py; `serve --slots`).

A server holds `slots` sequences of up to the model's positions: their KV cache (kv_cache.py,
allocated when it starts) and, at worst, one first pass over every slot's prompt at full
length. That pass is estimated as one forward pass over rows x width positions, from
megatron-core's GPTModel and the runner (T5's recomputing decoder runs such a pass at every
step):

- logits: the output layer's [width, rows, padded vocab] and GPTModel's batch-first copy of it
  (`transpose(0, 1).contiguous()`), in the model's dtype; then the runner's float32 copy
  (`.float()`) unless the model is float32, and on a GPU the host copy (`.cpu()`);
- one layer's activations at a time (inference keeps no layer's activations for later):
  attention scores [rows x heads, width, width] with the masked-softmax output (and float32
  copies of both for a 16-bit model's fp32 softmax), the MLP's fc1 output and its activation
  (fc1 is twice as wide for a gated activation such as SwiGLU), and hidden-sized tensors (the
  input, norms, projections, the residual);
- the token ids (int64) and the engine's Python lists of them, on the host.

tests/test_serving.py measures a forward pass's peak against this estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30
# Of the memory free when a request arrives, the part one request may take: the rest is
# headroom for the allocator, the server, and whatever else runs on the machine.
REQUEST_SHARE = 0.8
HIDDEN_SIZED = 8  # hidden-sized tensors alive at once in a layer (input, norm, QKV parts, ...)
SCORE_COPIES = 4  # the scores buffer, its scaled and masked forms, the softmax output
# The C allocator keeps some of the freed layer activations (heap, not returned to the system)
# while the logits are allocated: the process's peak exceeds the peak of live tensors.
ALLOCATOR_MARGIN = 1.15
PYTHON_BYTES_PER_TOKEN = 48  # a list slot (8) and an int object (28), rounded up


@dataclass(frozen=True)
class ForwardShape:
    """What one rank's forward pass allocates per position depends on."""

    hidden: int
    ffn_hidden: int  # per rank (divided by TP)
    heads: int  # per rank (divided by TP)
    gated: bool
    padded_vocab: int
    vocab: int
    dtype_bytes: int
    on_gpu: bool

    def bytes_needed(self, rows: int, width: int) -> tuple[int, int]:
        """(accelerator bytes, host bytes) of a forward pass over rows x width tokens; on a CPU
        everything is host memory and the first is 0."""
        positions = rows * width
        size = self.dtype_bytes
        logits = 2 * positions * self.padded_vocab * size
        as_float = positions * self.vocab * 4 if size != 4 else 0
        fp32_softmax = 8 if size < 4 else 0
        attention = rows * self.heads * width * width * (SCORE_COPIES * size + fp32_softmax)
        mlp = positions * self.ffn_hidden * size * (3 if self.gated else 2)
        layer = max(attention, mlp) + HIDDEN_SIZED * positions * self.hidden * size
        tokens = positions * 8
        model = logits + as_float + layer + tokens
        python = positions * PYTHON_BYTES_PER_TOKEN
        if self.on_gpu:
            return model, int((python + positions * self.vocab * 4) * ALLOCATOR_MARGIN)
        return 0, int((model + python) * ALLOCATOR_MARGIN)


@dataclass(frozen=True)
class Budget:
    """Bytes one request may use now: on the accelerator (None without one) and on the host."""

    device: int | None
    host: int

    def fits(self, needed: tuple[int, int]) -> bool:
        device, host = needed
        return host <= self.host and (self.device is None or device <= self.device)


def budget_now(on_gpu: bool) -> Budget:
    """REQUEST_SHARE of the memory free now, for the host (what the machine and this process's
    cgroup allow, the tighter) and the GPU (free plus what torch holds unused)."""
    device = None
    if on_gpu:
        import torch

        free, _total = torch.cuda.mem_get_info()
        cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        device = int((free + cached) * REQUEST_SHARE)
    return Budget(device, int(available_host_memory() * REQUEST_SHARE))


def available_host_memory() -> int:
    """MemAvailable, or what is left under this process's cgroup limit when that is less (a
    Slurm job or a container is killed at its cgroup's limit, not the machine's)."""
    available = _meminfo("MemAvailable")
    left = _cgroup_left()
    return available if left is None else min(available, left)


def _meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise OSError(f"/proc/meminfo has no {key}")


def _cgroup_left() -> int | None:
    """The cgroup's limit less what it holds that cannot be reclaimed (usage less inactive page
    cache), at the tightest level of this process's cgroup path; None where no limit is set.
    cgroup v2 (memory.max, memory.current) and v1 (memory.limit_in_bytes, usage_in_bytes)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    tightest: int | None = None
    for line in lines:
        _id, controllers, path = line.split(":", 2)
        if controllers == "":
            root, files = Path("/sys/fs/cgroup"), ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            root = Path("/sys/fs/cgroup/memory")
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        folder = root / path.lstrip("/")
        while root == folder or root in folder.parents:
            left = _left_in(folder, *files)
            if left is not None:
                tightest = left if tightest is None else min(tightest, left)
            folder = folder.parent
    return tightest


def _left_in(folder: Path, limit_file: str, usage_file: str) -> int | None:
    try:
        limit_text = (folder / limit_file).read_text().strip()
        usage = int((folder / usage_file).read_text().strip())
        stat = (folder / "memory.stat").read_text().split()
    except (OSError, ValueError):
        return None
    if limit_text == "max":
        return None
    limit = int(limit_text)
    if limit >= 2**60:  # cgroup v1 writes "no limit" as a huge number
        return None
    values = dict(zip(stat[::2], stat[1::2], strict=False))
    cache = int(values.get("total_inactive_file", values.get("inactive_file", "0")))
    return max(limit - max(usage - cache, 0), 0)


def slots_problem(
    shape: ForwardShape, budget: Budget, slots: int, positions: int, cache_per_slot: int
) -> str | None:
    """Why a server cannot hold `slots` sequences of up to `positions` tokens: their KV cache
    (`cache_per_slot` bytes each, on the model's device) and the worst first pass (every slot's
    prompt at full length at once); None when it fits. The message names the most that fit."""

    def needed(count: int) -> tuple[int, int]:
        device, host = shape.bytes_needed(count, positions)
        cache = count * cache_per_slot
        return (device + cache, host) if shape.on_gpu else (device, host + cache)

    if budget.fits(needed(slots)):
        return None
    low, high = 0, slots
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if budget.fits(needed(middle)) else (low, middle - 1)
    advice = f"at most {low} fit" if low else "not even one fits: free memory or serve on a GPU"
    return (
        f"--slots {slots} needs about {_describe(*needed(slots))} for the KV cache of {slots} "
        f"sequences of {positions} tokens and their first pass, more than the "
        f"{_describe(budget.device, budget.host)} free for it: {advice}"
    )


def _describe(device: int | None, host: int) -> str:
    def gib(value: int) -> str:
        return f"{math.ceil(value / GIB * 100) / 100:.2f} GiB"

    if not device:  # None or 0: a CPU server, where all of it is host memory
        return f"{gib(host)} of memory"
    return f"{gib(device)} of GPU memory and {gib(host)} of host memory"
