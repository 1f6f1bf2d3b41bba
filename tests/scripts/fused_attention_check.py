"""The fused local attention (jobs/inference/fused_attention.py) against megatron-core's local
DotProductAttention on the same inputs, one process; prints one JSON object for
tests/test_kv_cache.py:

python -m tests.scripts.fused_attention_check

Grouped and plain heads; a causal square (a prompt's pass), a cache step (one query over more
keys) and left-padded rows whose padding queries see no key at all (compared where a query
sees a key; finite everywhere).
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


def compare(heads: int, groups: int) -> dict[str, float]:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from launcher_scripts.jobs.inference.fused_attention import FusedLocalAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=16 * heads,
        num_attention_heads=heads,
        num_query_groups=groups,
        use_cpu_initialization=True,
    )
    local = DotProductAttention(config, 1, AttnMaskType.causal, "self").eval()
    fused = FusedLocalAttention(local)
    generator = torch.Generator().manual_seed(heads * 10 + groups)
    found = {}
    for name, (queries, keys, mask) in cases().items():
        rows = mask.shape[0]
        q = torch.randn(queries, rows, heads, 16, generator=generator)
        k = torch.randn(keys, rows, groups, 16, generator=generator)
        v = torch.randn(keys, rows, groups, 16, generator=generator)
        with torch.inference_mode():
            expected = local(q, k, v, mask)
            got = fused(q, k, v, mask)
        finite = bool(torch.isfinite(got).all())
        # [queries, rows]: the queries that see a key (a padding query sees none, and its
        # output is never read: both sides keep it finite, each its own way).
        seen = (~mask).any(dim=-1)[:, 0].transpose(0, 1)
        difference = (expected - got).abs().amax(dim=-1)[seen]
        found[name] = float(difference.max()) if finite else float("inf")
    return found


def cases() -> dict[str, tuple[int, int, torch.Tensor]]:
    causal = torch.ones(6, 6, dtype=torch.bool).triu(diagonal=1)[None, None]
    step = torch.tensor([[False] * 9, [True] * 3 + [False] * 6])[:, None, None, :]
    starts = torch.tensor([0, 3])  # the second row's prompt is 3 shorter: left padding
    keys, queries = torch.arange(6), torch.arange(6)
    padded = (keys[None, None, :] < starts[:, None, None]) | (
        keys[None, None, :] > queries[None, :, None]
    )
    return {"causal": (6, 6, causal.expand(2, 1, 6, 6)), "step": (1, 9, step),
            "left_padded": (6, 6, padded[:, None])}  # fmt: skip


def main() -> None:
    from megatron.core import parallel_state

    from launcher_scripts.jobs.training import cpu_compat

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cpu_compat.patch_cuda_queries()
    with cpu_compat.CudaDevicesOnCpu():
        parallel_state.initialize_model_parallel(1, 1)
        cpu_compat.install()
        cpu_compat.seed_model_parallel_rngs(1234)
        report = {f"{heads}x{groups}": compare(heads, groups) for heads, groups in ((4, 4), (4, 2))}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
