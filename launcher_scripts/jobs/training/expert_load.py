"""What a mixture-of-experts model's routers did: the tokens each expert of each MoE layer was
given and the routing losses, per logged window of steps, and a plot of the load at the end.

The counts come from the routers' outputs (a forward hook on megatron-core's TopKRouter: its
routing map, tokens x experts), counted in training forwards only, one row per layer of each
stack with experts (GPT's decoder; T5's encoder and decoder). Every rank routes tokens of its
own (megatron-core trains MoE layers under TP only with sequence parallelism, and CP ranks
hold parts of the sequence), so the counts are summed over all ranks when a step is logged.
The losses are megatron-core's own records (its aux-loss tracker): each TP x CP rank records
its tokens' part of a micro-batch's loss at each MoE layer, so their sum over all ranks and
layers divided by the router forwards (over TP x CP) is the mean over the window's MoE layers,
micro-batches and data-parallel ranks. Loads are shares of the even split: 1.0 is an expert
given exactly tokens x top_k / experts of the window's tokens, 2.0 twice that.
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

# megatron-core's names of the routing losses it records (router.py).
LOSS_NAMES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss")
LOSS_NAMES += ("z_loss",)


def expert_stacks(config: Any) -> dict[str, Any]:
    """A model's stacks with experts, by name: its config's (and an encoder-decoder's encoder
    config's, T5's)."""
    encoder = getattr(config, "encoder_config", None)
    stacks = {"encoder": encoder, "decoder": config} if encoder is not None else {"layer": config}
    return {name: c for name, c in stacks.items() if c.num_moe_experts}


class ExpertLoad:
    def __init__(self, chunks: list[Any], stacks: dict[str, Any]) -> None:
        """`stacks`: the megatron-core configs of the model's stacks with experts, by the name
        a plot gives them ("layer"; T5's "encoder", "decoder"): a router belongs to the stack
        whose config it holds. Every rank gives all of them, whatever its pipeline stage."""
        self.rows: dict[tuple[int, int], int] = {}
        self.labels: list[str] = []
        experts: list[int] = []
        configs = list(stacks.values())
        for which, (name, config) in enumerate(stacks.items()):
            for layer in range(config.num_layers):
                self.rows[(which, layer)] = len(self.rows)
                self.labels.append(f"{name} {layer + 1}")
                experts.append(int(config.num_moe_experts))
        self.experts = torch.tensor(experts, dtype=torch.float64)
        self.window = torch.zeros(len(self.rows), max(experts), dtype=torch.float64)
        self.forwards = torch.zeros(1, dtype=torch.float64)
        self.run = torch.zeros_like(self.window)
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    which = next(i for i, c in enumerate(configs) if c is module.config)
                    row = self.rows[(which, int(module.layer_number) - 1)]
                    module.register_forward_hook(self._hook(row))
        self.parts = parallel_state.get_tensor_model_parallel_world_size()
        self.parts *= parallel_state.get_context_parallel_world_size()
        # megatron-core sizes its loss record by the first router's stack; T5's encoder and
        # decoder may differ: a record as long as the longest, made before any router runs.
        longest = max(config.num_layers for config in configs)
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        for name in LOSS_NAMES:
            tracker.setdefault(name, {"values": torch.zeros(longest)})

    def _hook(self, row: int) -> Any:
        def count(router: Any, _inputs: Any, output: Any) -> None:
            if not (router.training and torch.is_grad_enabled()):
                return
            _probs, routing_map = output
            counts = routing_map.detach().sum(0).to("cpu", torch.float64)
            self.window[row, : counts.numel()] += counts
            self.forwards += 1

        return count

    def window_metrics(self) -> dict[str, float]:
        """The window's load spread and routing losses, the same on every rank; the window is
        then cleared."""
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        names = [name for name in LOSS_NAMES if name in tracker]
        losses = [tracker[name]["values"].detach().sum().to("cpu", torch.float64) for name in names]
        packed = torch.cat([self.window.flatten(), self.forwards, torch.stack(losses)])
        dist.all_reduce(packed)
        counts = packed[: self.window.numel()].view_as(self.window)
        forwards = float(packed[self.window.numel()]) / self.parts
        self.window.zero_()
        self.forwards.zero_()
        moe_utils.clear_aux_losses_tracker()
        self.run += counts
        routed = counts.sum(1) > 0
        record: dict[str, float] = {}
        if routed.any():
            shares = self._shares(counts, routed)
            record["moe_load_max"] = max(float(row.max()) for row in shares)
            record["moe_load_min"] = min(float(row.min()) for row in shares)
            stds = [float(row.std(unbiased=False)) for row in shares]
            record["moe_load_std"] = sum(stds) / len(stds)
        for name, total in zip(names, packed[self.window.numel() + 1 :], strict=True):
            if forwards and float(total):
                record[f"moe_{name}"] = float(total) / forwards
        return record

    def _shares(self, counts: torch.Tensor, routed: torch.Tensor) -> list[torch.Tensor]:
        """Each routed row's counts over its own experts, as shares of the even split."""
        rows = []
        for index in routed.nonzero().flatten().tolist():
            experts = int(self.experts[index])
            row = counts[index, :experts]
            rows.append(row / row.mean())
        return rows

    def plot(self, output: Path, title: str) -> bool:
        """expert_load.png: each MoE layer's share of tokens per expert over the run (since
        this process started); False when nothing was routed."""
        routed = self.run.sum(1) > 0
        if not routed.any():
            return False
        from matplotlib.figure import Figure

        shares = self._shares(self.run, routed)
        width = max(row.numel() for row in shares)
        grid = torch.full((len(shares), width), float("nan"), dtype=torch.float64)
        for i, row in enumerate(shares):
            grid[i, : row.numel()] = row
        labels = [self.labels[i] for i in routed.nonzero().flatten().tolist()]
        figure = Figure(figsize=(max(5.0, 0.5 * width + 3), max(3.0, 0.35 * len(labels) + 2)))
        axes = figure.subplots()
        image = axes.imshow(grid.numpy(), aspect="auto", cmap="viridis", vmin=0)
        axes.set_xlabel("expert")
        axes.set_ylabel("layer")
        axes.set_xticks(range(width))
        axes.set_yticks(range(len(labels)), labels)
        axes.set_title(f"{title}: expert load (1 = even share), run so far")
        figure.colorbar(image, ax=axes)
        save_figure(figure, output)
        return True
