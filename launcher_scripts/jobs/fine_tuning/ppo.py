"""PPO's training task (the rlhf_ppo stage, reference 5.16.2): the actor's job, with the other
three roles in it (`model.rlhf.layout: colocated`, ColocatedRoles) or served by jobs of their
own (`servers`: jobs/fine_tuning/ppo_remote.py asks jobs/fine_tuning/ppo_server.py's).

- The actor: the policy being trained, from the SFT model (every weight, or LoRA).
- The initial policy: the actor's starting weights, kept and swapped in for its pass (LoRA's:
  the base, the adapters at their start), which the KL penalty holds the actor near.
- The reward model: the rlhf_rm stage's file, built beside the actor in its layout; it scores
  each finished completion (standardised with the file's mean and std).
- The critic: a value per token, a second trained model (its own optimizer and schedule),
  started from the reward model (or `model.rlhf.critic.restore_from_path`), checkpointed and
  resumed with the actor.

A rollout batch (`num_rollout_samples` completions, one per prompt, jobs/fine_tuning/
rollouts.py) is scored: each token's reward is -coefficient x KL(actor at rollout | initial
policy) at that token, plus the reward model's score at the last one. The critic's values give
GAE(gamma, lambda) advantages and the returns; advantages are whitened over the batch. Then
`epochs` passes over the batch, shuffled, in global-batch mini-batches, one optimizer step of
actor and critic each: the actor's clipped surrogate loss (minus the entropy bonus), the
critic's clipped value loss. With `kl_target` the coefficient adapts after each batch
(Ziegler et al.'s proportional controller). Per step the log holds the reward, the KL and its
coefficient, the entropy, the clipped share, the value loss and the share of the step spent
generating; ppo_curves.png plots the rewards.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
from omegaconf import OmegaConf

from launcher_scripts.formats import portable
from launcher_scripts.jobs.fine_tuning import peft_file
from launcher_scripts.jobs.fine_tuning.preference_data import epoch_order, reduced_sums
from launcher_scripts.jobs.fine_tuning.rollouts import (
    SAMPLE_KEYS,
    Rollout,
    RolloutTask,
    Swapped,
)
from launcher_scripts.jobs.fine_tuning.tuner import file_size
from launcher_scripts.jobs.training.checkpointing import unwrap
from launcher_scripts.jobs.training.trainer import Streams, TrainedBeside, Trainer
from launcher_scripts.recipes.ppo import PpoSettings

KEYS = (*SAMPLE_KEYS, "advantages", "returns", "old_logps", "old_values")
# The sums one actor micro-batch reports, in this order.
ACTOR_STATS = ("tokens", "clipped", "entropy", "approx_kl")
# The sums one critic micro-batch reports.
CRITIC_STATS = ("tokens", "value_loss", "clipped")
CRITIC_FILE = "critic.nemo"


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """The entropy of each position's distribution from its logits split over the
    tensor-parallel ranks' vocabulary shares ([..., vocab / tp] -> [...]), differentiable: the
    partial sums are all-reduced forward and their gradients pass through unchanged."""
    top = logits.detach().max(dim=-1, keepdim=True).values
    group = parallel_state.get_tensor_model_parallel_group()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top
    exp = shifted.exp()
    total = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    weighted = reduce_from_tensor_model_parallel_region((exp * shifted).sum(dim=-1))
    return total.log() - weighted / total


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log pi(label) per position, from vocabulary-parallel logits [b, s, v / tp]."""
    # megatron-core's cross entropy shifts its input in place: give it a copy.
    copy = logits.clone() if logits.dtype == torch.float32 else logits.float()
    return -tensor_parallel.vocab_parallel_cross_entropy(copy, labels)


def actor_loss(
    settings: PpoSettings, mode: str, batch: dict[str, torch.Tensor], logits: torch.Tensor
) -> tuple[Any, Any, Any]:
    """The micro-batch's summed clipped surrogate loss (less the entropy bonus) over its
    completion tokens, their count, and the ACTOR_STATS sums; in "logps" mode (forward only)
    the per-token log-probabilities."""
    logits = logits.float()
    logps = token_logps(logits, batch["labels"])
    if mode == "logps":
        report = {"logps": logps.detach()}
        return logps.new_zeros(()), torch.ones((), dtype=torch.int), report
    mask = batch["loss_mask"].to(logps)
    advantages = batch["advantages"].to(logps)
    difference = logps - batch["old_logps"].to(logps)
    ratio = torch.exp(difference)
    eps = settings.ratio_eps
    surrogate = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - eps, 1 + eps))
    if settings.entropy_bonus:
        entropy = vocab_parallel_entropy(logits)
        surrogate = surrogate - settings.entropy_bonus * entropy
    else:
        with torch.no_grad():
            entropy = vocab_parallel_entropy(logits)
    loss = (surrogate * mask).sum()
    tokens = mask.sum()
    was_clipped = ((ratio - 1).abs() > eps).to(logps)
    stats = torch.stack(
        [
            tokens,
            (was_clipped * mask).sum(),
            (entropy.detach() * mask).sum(),
            # k1 and k3 agree near 0; k3 (exp(-d) - 1 + d) is never negative.
            ((torch.exp(-difference) - 1 + difference).detach() * mask).sum(),
        ]
    )
    report = {"lm loss": torch.stack([loss.detach(), tokens]), "ppo": stats}
    return loss, tokens.to(torch.int), report


def critic_loss(
    settings: PpoSettings, mode: str, batch: dict[str, torch.Tensor], output: torch.Tensor
) -> tuple[Any, Any, Any]:
    """The micro-batch's summed value loss over its completion tokens (half the squared
    error to the returns, the larger of the clipped and unclipped one), their count and the
    CRITIC_STATS sums; in "values" mode (forward only) the per-token values."""
    values = output[..., 0].float()
    if mode == "values":
        return values.new_zeros(()), torch.ones((), dtype=torch.int), {"values": values.detach()}
    mask = batch["loss_mask"].to(values)
    returns = batch["returns"].to(values)
    error = (values - returns) ** 2
    clip = settings.critic_loss_clip_value
    clipped = torch.zeros_like(error)
    if clip:
        old = batch["old_values"].to(values)
        held = old + (values - old).clamp(-clip, clip)
        held_error = (held - returns) ** 2
        clipped = (held_error > error).to(values)
        error = torch.max(error, held_error)
    loss = 0.5 * (error * mask).sum()
    tokens = mask.sum()
    stats = torch.stack([tokens, loss.detach(), (clipped * mask).sum()])
    report = {"lm loss": torch.stack([loss.detach(), tokens]), "critic": stats}
    return loss, tokens.to(torch.int), report


def gae(
    rewards: torch.Tensor, values: torch.Tensor, discount: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and returns of one completion's tokens (rewards and
    values per token, the value after the last token 0)."""
    advantages = torch.zeros_like(rewards)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        following = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + discount * following - values[t]
        running = delta + discount * lam * running
        advantages[t] = running
    return advantages, advantages + values


def adapted_coefficient(
    coefficient: float, kl: float, target: float, horizon: int, samples: int
) -> float:
    """The adaptive KL penalty's next coefficient (Ziegler et al. 2019): proportional to the
    KL's error against the target, clipped to +-20%, over `horizon` samples."""
    error = max(-0.2, min(0.2, kl / target - 1))
    return coefficient * (1 + error * samples / horizon)


class ColocatedRoles:
    """The initial policy, the critic and (through the task's scorers) the reward model in the
    actor's job: the critic trained beside the actor, the initial policy the actor's starting
    weights swapped in."""

    def __init__(self, task: PpoTask, trainer: Trainer) -> None:
        from launcher_scripts.jobs.conversion import load

        path = task.settings.critic
        self.file = portable.read(path, trainer.log_dir, extract=False)
        par, precision = trainer.layout, trainer.cfg.trainer.precision
        chunks = load.build(self.file, par.tensor, par.pipeline, trainer.on_gpu, precision)
        for chunk in chunks:
            chunk.train()
        optim = OmegaConf.merge(trainer.cfg.model.optim, task.settings.critic_optim)
        self.critic = trainer.train_beside(chunks, chunks[0].config, optim)
        self.settings, self.mode = task.settings, "train"
        trainer.say(f"critic from {path}: learning rate {float(optim.lr):g}")

    def _forward(self, batch: dict[str, Any], model: Any) -> tuple[Any, Any]:
        output = model(batch["tokens"], batch["position_ids"], None)
        return output, partial(critic_loss, self.settings, self.mode, batch)

    def reference_logps(self, task: PpoTask, trainer: Trainer) -> None:
        with Swapped(task.starting_values):
            task.attach_logps(trainer, "ref_logps")

    def critic_values(self, task: PpoTask, trainer: Trainer) -> None:
        self.mode = "values"
        try:
            task.attach_rows(trainer, "old_values", "values", self.critic.model, self._forward)
        finally:
            self.mode = "train"

    def train_critic(self, task: PpoTask, trainer: Trainer, start: int) -> dict[str, float]:
        del task
        outputs = trainer.step_beside(self.critic, start, trainer.train_stream, self._forward)
        return reduced_sums(outputs, "critic", CRITIC_STATS, trainer.device)

    def trained_beside(self) -> dict[str, TrainedBeside]:
        return {"critic": self.critic}

    def on_checkpoint(self, trainer: Trainer) -> None:
        del trainer  # the critic is in the actor's checkpoint

    def check_resumed(self, trainer: Trainer) -> None:
        del trainer

    def write(self, task: PpoTask, trainer: Trainer) -> None:
        """critic.nemo: a reward model's file with the critic's weights (the next run's
        critic)."""
        tensors = peft_file.gather_full([unwrap(c) for c in self.critic.model], lambda key: True)
        if trainer.rank == 0 and tensors is not None:
            config = self.file.config.copy()
            # The same tokenizer (preflight compares them), the base's files extracted here.
            config.tokenizer = task.base.config.tokenizer
            config.tensor_model_parallel_size = trainer.layout.tensor
            config.pipeline_model_parallel_size = trainer.layout.pipeline
            path = task.spec.output_file.parent / CRITIC_FILE
            portable.write(path, config, tensors)
            trainer.say(f"critic ({file_size(path)}): {path}")

    def finish(self, trainer: Trainer) -> None:
        del trainer


class PpoTask(RolloutTask):
    settings: PpoSettings
    settings_key = "model.rlhf.ppo"
    curves_file = "ppo_curves.png"

    def __init__(self, cfg: Any, spec: Any, base: Any) -> None:
        super().__init__(cfg, spec, base)
        self.roles: Any = None  # ColocatedRoles, or ppo_remote.ServedRoles

    def uses_reference(self) -> bool:
        # The KL to the initial policy is in every reward and every log line; served, the
        # initial policy is a server's.
        return self.settings.layout == "colocated"

    def completions_per_prompt(self) -> int:
        return 1

    def rollout_size(self, trainer: Trainer) -> int:
        del trainer
        return self.settings.num_rollout_samples

    def steps_per_rollout(self, trainer: Trainer) -> int:
        gbs = int(trainer.cfg.model.global_batch_size)
        return self.settings.epochs * self.settings.num_rollout_samples // gbs

    def sample_keys(self) -> tuple[str, ...]:
        return KEYS

    def sample_order(self, trainer: Trainer, cycle: int) -> list[int]:
        """Each epoch over the batch in its own shuffled order (by the seed and the batch)."""
        count = len(self.batch.samples)
        return [
            index
            for epoch in range(self.settings.epochs)
            for index in epoch_order(count, trainer.seed + cycle, epoch)
        ]

    # ----- the roles ------------------------------------------------------------------------

    def build_data(self, trainer: Trainer) -> Streams:
        if self.settings.layout == "servers":
            from launcher_scripts.jobs.fine_tuning.ppo_remote import ServedRoles

            self.roles = ServedRoles(trainer.log_dir)
        streams = super().build_data(trainer)
        if self.roles is None:
            self.roles = ColocatedRoles(self, trainer)
        return streams

    def make_scorers(self, trainer: Trainer) -> list[Any]:
        if self.settings.layout == "servers":
            from launcher_scripts.jobs.fine_tuning.ppo_remote import ServedScorer

            return [ServedScorer(self.settings.reward, self.roles.reward, self.tokenizer.eod_id)]
        return super().make_scorers(trainer)

    def trained_beside(self) -> dict[str, TrainedBeside]:
        return self.roles.trained_beside() if self.roles is not None else {}

    def before_training(self, trainer: Trainer) -> None:
        self.roles.check_resumed(trainer)
        super().before_training(trainer)

    def on_checkpoint(self, trainer: Trainer) -> None:
        super().on_checkpoint(trainer)
        self.roles.on_checkpoint(trainer)

    # ----- rollouts -----------------------------------------------------------------------

    def prepare(self, trainer: Trainer, rollouts: list[Rollout]) -> None:
        settings = self.settings
        self.batch.samples = [self.sample(rollout) for rollout in rollouts]
        self.attach_logps(trainer, "old_logps")
        self.roles.reference_logps(self, trainer)
        self.roles.critic_values(self, trainer)
        coefficient = float(trainer.state.task.get("kl_coef", settings.initial_policy_kl_penalty))
        kls, values, returns = [], [], []
        for rollout, sample in zip(rollouts, self.batch.samples, strict=True):
            positions = sample["loss_mask"].nonzero().flatten()
            difference = (sample["old_logps"] - sample.pop("ref_logps"))[positions].double()
            kl = difference.abs() if settings.use_absolute_kl else difference
            rewards = -coefficient * kl
            rewards[-1] += rollout.reward
            value = sample["old_values"][positions].double()
            advantage, to_go = gae(rewards, value, settings.discount, settings.gae_lambda)
            sample["advantages"] = torch.zeros(self.seq_length)
            sample["advantages"][positions] = advantage.float()
            sample["returns"] = torch.zeros(self.seq_length)
            sample["returns"][positions] = to_go.float()
            kls.append(float(difference.sum()))
            values.append(float(value.mean()))
            returns.append(float(to_go[0]))
        if settings.normalize_advantage:
            self._whiten()
        kl = sum(kls) / len(kls)
        self.rollout_stats = {
            "kl": kl,
            "kl_coef": coefficient,
            "values": sum(values) / len(values),
            "returns": sum(returns) / len(returns),
        }
        if settings.kl_target is not None:
            coefficient = adapted_coefficient(
                coefficient, kl, settings.kl_target, settings.kl_horizon, len(rollouts)
            )
        trainer.state.task["kl_coef"] = coefficient

    def _whiten(self) -> None:
        """The advantages of every completion token of the batch to mean 0, std 1."""
        samples = self.batch.samples
        chosen = torch.cat([s["advantages"][s["loss_mask"] > 0] for s in samples]).double()
        mean, std = chosen.mean(), chosen.std() if len(chosen) > 1 else torch.tensor(1.0)
        for sample in samples:
            inside = sample["loss_mask"] > 0
            whitened = (sample["advantages"].double() - mean) / (std + 1e-8)
            sample["advantages"] = torch.where(inside, whitened, 0.0).float()

    def forward_step(self, trainer: Trainer, batch: dict[str, Any], model: Any) -> tuple[Any, Any]:
        output = model(batch["tokens"], batch["position_ids"], None)
        return output, partial(actor_loss, self.settings, self.mode, batch)

    # ----- a step -------------------------------------------------------------------------

    def after_step(self, trainer: Trainer, outputs: list[Any], seconds: float) -> None:
        """The critic's step on the mini-batch the actor just trained on, then the log."""
        gbs = int(trainer.cfg.model.global_batch_size)
        critic = self.roles.train_critic(self, trainer, trainer.state.consumed_samples - gbs)
        actor = reduced_sums(outputs, "ppo", ACTOR_STATS, trainer.device)
        tokens, critic_tokens = max(actor["tokens"], 1.0), max(critic["tokens"], 1.0)
        record = self.rollout_metrics(self.rollouts)
        record |= self.rollout_stats
        record["entropy"] = actor["entropy"] / tokens
        record["clip_ratio"] = actor["clipped"] / tokens
        record["approx_kl"] = actor["approx_kl"] / tokens  # to the policy that sampled
        record["value_loss"] = critic["value_loss"] / critic_tokens
        record["value_clip_ratio"] = critic["clipped"] / critic_tokens
        self.log_step(
            trainer,
            record,
            seconds,
            f"reward {record['reward']:.3f}, kl {record['kl']:.4f} (coefficient "
            f"{record['kl_coef']:.4f}), entropy {record['entropy']:.3f}, value loss "
            f"{record['value_loss']:.4f}, clipped {record['clip_ratio']:.3f}",
        )

    # ----- outputs ------------------------------------------------------------------------

    def write_outputs(self, trainer: Trainer) -> None:
        """The actor's file (as SFT's), the critic's beside it (colocated), and the servers
        stopped (served)."""
        super().write_outputs(trainer)
        self.roles.write(self, trainer)
        dist.barrier()
        self.roles.finish(trainer)
