"""Group-relative policy optimisation's training task (the grpo stage).

Each optimizer step trains on completions the policy itself samples (jobs/fine_tuning/
rollouts.py): the next `global_batch_size / num_generations` prompts, `num_generations`
completions of each, scored with the recipe's reward functions or reward models. Every
completion gets its group's advantage: its reward less its group's mean, divided by the group's
(or the batch's) standard deviation. The loss is PPO's clipped objective on the policy's
per-token probability ratio to the policy that sampled them (1 on the first of `num_iterations`
steps over a batch), plus `beta` times the k3 estimate of the KL divergence to the reference
(the starting policy: its trainable weights are kept and swapped in for the reference's pass),
averaged over tokens as `loss_type` says (TRL's GRPOTrainer's definitions).

Per step the log holds the reward (mean, and its standard deviation within groups), each
reward's mean, the completions' length and truncated share, the clipped share of tokens, the KL
when beta > 0, and the share of the step spent generating. Validation answers the held-out
prompts greedily and reports their mean reward (grpo_curves.png plots both).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from launcher_scripts.jobs.fine_tuning.preference_data import reduced_sums
from launcher_scripts.jobs.fine_tuning.rollouts import (
    SAMPLE_KEYS,
    Rollout,
    RolloutTask,
    Swapped,
    logps_report,
)
from launcher_scripts.jobs.training.trainer import Trainer
from launcher_scripts.recipes.grpo import GrpoSettings

KEYS = (*SAMPLE_KEYS, "advantages", "old_logps", "ref_logps")
# The sums one training micro-batch reports, in this order.
STATS = ("tokens", "clipped", "kl", "sequences")


def advantages(rewards: torch.Tensor, groups: int, scale: str) -> torch.Tensor:
    """Each completion's reward less its group's mean (groups: consecutive `groups`
    completions), divided by the group's standard deviation, the batch's, or nothing."""
    grouped = rewards.view(-1, groups)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    if scale == "none":
        return centred
    if scale == "group":
        spread = grouped.std(dim=1, keepdim=True).expand_as(grouped).reshape(-1)
    else:
        spread = rewards.std().expand_as(rewards)
    return centred / (spread + 1e-4)


def grpo_loss(
    settings: GrpoSettings, batch: dict[str, torch.Tensor], output: torch.Tensor
) -> tuple[Any, Any, Any]:
    """The micro-batch's summed loss and what it is divided by over the global batch (tokens
    for dapo; sequences for grpo, each its token mean; sequences x max length for dr_grpo),
    with the STATS sums. `output`: the per-token negative log-likelihood of the labels."""
    logps = -output.float()
    mask = batch["loss_mask"].to(logps)
    old = batch["old_logps"].to(logps) if "old_logps" in batch else logps.detach()
    advantage = batch["advantages"].to(logps)[:, None]
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - settings.epsilon, 1 + settings.epsilon_high)
    token_loss = -torch.min(ratio * advantage, clipped * advantage)
    kl = torch.zeros_like(logps)
    if settings.beta:
        difference = batch["ref_logps"].to(logps) - logps
        kl = torch.exp(difference) - difference - 1
        token_loss = token_loss + settings.beta * kl
    counts = mask.sum(dim=1)
    sequences = (counts > 0).to(logps)
    if settings.loss_type == "grpo":
        loss = ((token_loss * mask).sum(dim=1) / counts.clamp(min=1.0)).sum()
        divisor = sequences.sum()
    elif settings.loss_type == "dr_grpo":
        loss = (token_loss * mask).sum()
        divisor = sequences.sum() * settings.max_completion_length
    else:
        loss = (token_loss * mask).sum()
        divisor = mask.sum()
    was_clipped = ((ratio < 1 - settings.epsilon) & (advantage < 0)) | (
        (ratio > 1 + settings.epsilon_high) & (advantage > 0)
    )
    stats = torch.stack(
        [
            mask.sum(),
            (was_clipped.to(logps) * mask).sum(),
            (kl.detach() * mask).sum(),
            sequences.sum(),
        ]
    )
    report = {"lm loss": torch.stack([loss.detach(), divisor.detach()]), "grpo": stats}
    return loss, divisor.to(torch.int), report


class GrpoTask(RolloutTask):
    settings: GrpoSettings
    settings_key = "model.grpo"
    curves_file = "grpo_curves.png"

    def completions_per_prompt(self) -> int:
        return self.settings.num_generations

    def rollout_size(self, trainer: Trainer) -> int:
        return int(trainer.cfg.model.global_batch_size)

    def steps_per_rollout(self, trainer: Trainer) -> int:
        del trainer
        return self.settings.num_iterations

    def uses_reference(self) -> bool:
        return bool(self.settings.beta)

    def sample_keys(self) -> tuple[str, ...]:
        return KEYS

    def prepare(self, trainer: Trainer, rollouts: list[Rollout]) -> None:
        settings = self.settings
        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float64)
        scaled = advantages(rewards, settings.num_generations, settings.scale_rewards)
        masked = settings.mask_truncated_completions
        self.batch.samples = []
        for rollout, advantage in zip(rollouts, scaled.tolist(), strict=True):
            sample = self.sample(rollout, in_loss=not (rollout.truncated and masked))
            sample["advantages"] = torch.tensor(advantage, dtype=torch.float32)
            self.batch.samples.append(sample)
        if settings.num_iterations > 1:
            self.attach_logps(trainer, "old_logps")
        if settings.beta:
            with Swapped(self.starting_values):  # the reference: the starting policy
                self.attach_logps(trainer, "ref_logps")

    def forward_step(self, trainer: Trainer, batch: dict[str, Any], model: Any) -> tuple[Any, Any]:
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        if self.mode == "logps":
            return output, partial(logps_report, batch)
        return output, partial(grpo_loss, self.settings, batch)

    # ----- what a step logs ---------------------------------------------------------------

    def after_step(self, trainer: Trainer, outputs: list[Any], seconds: float) -> None:
        totals = reduced_sums(outputs, "grpo", STATS, trainer.device)
        tokens = max(totals["tokens"], 1.0)
        record = self.rollout_metrics(self.rollouts)
        groups = self.settings.num_generations
        rewards = torch.tensor([r.reward for r in self.rollouts], dtype=torch.float64)
        record["reward_std"] = float(rewards.view(-1, groups).std(dim=1).mean())
        record["clip_ratio"] = totals["clipped"] / tokens
        if self.settings.beta:
            record["kl"] = totals["kl"] / tokens
        self.log_step(
            trainer,
            record,
            seconds,
            f"reward {record['reward']:.3f} (std within groups {record['reward_std']:.3f}), "
            f"completion length {record['completion_length']:.1f}, clipped "
            f"{record['clip_ratio']:.3f}" + (f", kl {record['kl']:.4f}" if "kl" in record else ""),
        )
