"""What a mixture-of-experts model's routers did: the tokens each expert of each MoE layer was
given and the routing losses, per logged window of steps, and a plot of the load at the end.

The counts come from the routers' outputs (a forward hook on megatron-core's TopKRouter: its
routing map, tokens x experts), counted in training forwards only. Every rank routes tokens of
its own (megatron-core trains MoE layers under TP only with sequence parallelism, and CP ranks
hold parts of the sequence), so the counts are summed over all ranks when a step is logged.
The losses are megatron-core's own per-layer records (its aux-loss tracker): each TP x CP
rank records its tokens' part of a micro-batch's loss, so their sum over all ranks divided by
the micro-batches (forwards over TP x CP) is the mean over the window's micro-batches and
data-parallel ranks; the logged value is its mean over the MoE layers. Loads are shares of the
even split: 1.0 is an expert given exactly tokens x top_k / experts of the window's tokens,
2.0 twice that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter

from launcher_scripts.jobs.training.metrics import save_figure


class ExpertLoad:
    def __init__(self, chunks: list[Any], num_layers: int, experts: int) -> None:
        self.num_layers, self.experts = num_layers, experts
        self.window = torch.zeros(num_layers, experts, dtype=torch.float64)
        self.forwards = torch.zeros(num_layers, dtype=torch.float64)
        self.run = torch.zeros(num_layers, experts, dtype=torch.float64)
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    module.register_forward_hook(self._count)
        self.parts = parallel_state.get_tensor_model_parallel_world_size()
        self.parts *= parallel_state.get_context_parallel_world_size()

    def _count(self, router: Any, _inputs: Any, output: Any) -> None:
        if not (router.training and torch.is_grad_enabled()):
            return
        _probs, routing_map = output
        layer = int(router.layer_number) - 1
        self.window[layer] += routing_map.detach().sum(0).to("cpu", torch.float64)
        self.forwards[layer] += 1

    def window_metrics(self) -> dict[str, float]:
        """The window's load spread and routing losses, the same on every rank; the window is
        then cleared."""
        counts, forwards = self.window.clone(), self.forwards.clone()
        losses = moe_utils.get_moe_layer_wise_logging_tracker()
        names = sorted(losses)
        values = [losses[name]["values"].detach().to("cpu", torch.float64) for name in names]
        assert all(len(v) == self.num_layers for v in values), [len(v) for v in values]
        packed = torch.cat([counts.flatten(), forwards, *values])
        dist.all_reduce(packed)
        counts = packed[: counts.numel()].view_as(counts)
        forwards = packed[counts.numel() : counts.numel() + self.num_layers] / self.parts
        self.window.zero_()
        self.forwards.zero_()
        moe_utils.clear_aux_losses_tracker()
        self.run += counts
        rows = counts[counts.sum(1) > 0]
        record: dict[str, float] = {}
        if len(rows):
            shares = rows / rows.mean(1, keepdim=True)
            record["moe_load_max"] = float(shares.max())
            record["moe_load_min"] = float(shares.min())
            record["moe_load_std"] = float(shares.std(1, unbiased=False).mean())
        offset = counts.numel() + self.num_layers
        for name in names:
            per_layer = packed[offset : offset + self.num_layers]
            offset += self.num_layers
            seen = forwards > 0
            if seen.any():
                record[f"moe_{name}"] = float((per_layer[seen] / forwards[seen]).mean())
        return record

    def plot(self, output: Path, title: str) -> bool:
        """expert_load.png: each MoE layer's share of tokens per expert over the run (since
        this process started); False when nothing was routed."""
        rows = [layer for layer in range(self.num_layers) if self.run[layer].sum() > 0]
        if not rows:
            return False
        from matplotlib.figure import Figure

        shares = (self.run[rows] / self.run[rows].mean(1, keepdim=True)).numpy()
        figure = Figure(figsize=(max(5.0, 0.5 * self.experts + 3), max(3.0, 0.35 * len(rows) + 2)))
        axes = figure.subplots()
        image = axes.imshow(shares, aspect="auto", cmap="viridis", vmin=0)
        axes.set_xlabel("expert")
        axes.set_ylabel("layer")
        axes.set_yticks(range(len(rows)), [str(layer + 1) for layer in rows])
        axes.set_xticks(range(self.experts))
        axes.set_title(f"{title}: expert load (1 = even share), run so far")
        figure.colorbar(image, ax=axes)
        save_figure(figure, output)
        return True
