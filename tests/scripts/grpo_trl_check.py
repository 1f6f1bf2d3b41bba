"""The grpo stage's loss (jobs/fine_tuning/grpo.py `grpo_loss`) against TRL's own
`GRPOTrainer._compute_loss` on the same per-token log-probabilities, old and reference
log-probabilities, advantages and completion masks; prints one JSON object for
tests/test_grpo.py: per loss type and setting, the largest difference of the loss and of its
gradient with respect to the log-probabilities.

python -m tests.scripts.grpo_trl_check

TRL's method is called on a stand-in trainer holding only what it reads (its settings, an
accelerator of one process, a metrics store), with the model's forward replaced by the
given log-probabilities: the loss arithmetic is TRL's, unchanged.
"""

from __future__ import annotations

import json
from collections import defaultdict
from types import SimpleNamespace

import torch
from trl import GRPOTrainer

from launcher_scripts.jobs.fine_tuning.grpo import grpo_loss
from launcher_scripts.recipes.grpo import GrpoSettings

ROWS, WIDTH = 6, 5


class OneProcess:
    num_processes = 1
    sync_gradients = True

    @staticmethod
    def gather(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    gather_for_metrics = gather

    @staticmethod
    def reduce(tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor


def stand_in(settings: GrpoSettings, logps: torch.Tensor) -> SimpleNamespace:
    entropies = torch.zeros_like(logps)
    return SimpleNamespace(
        beta=settings.beta,
        epsilon_low=settings.epsilon,
        epsilon_high=settings.epsilon_high,
        loss_type=settings.loss_type,
        importance_sampling_level="token",
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=False,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        max_completion_length=settings.max_completion_length,
        current_gradient_accumulation_steps=1,
        accelerator=OneProcess(),
        model=SimpleNamespace(training=True),
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        _metrics=defaultdict(lambda: defaultdict(list)),
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logps, entropies, None),
    )


def compare(settings: GrpoSettings, seed: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(seed)
    base = -torch.rand(ROWS, WIDTH, generator=generator, dtype=torch.float64) * 3
    old = base + 0.3 * torch.randn(ROWS, WIDTH, generator=generator, dtype=torch.float64)
    reference = base + 0.2 * torch.randn(ROWS, WIDTH, generator=generator, dtype=torch.float64)
    advantages = torch.randn(ROWS, generator=generator, dtype=torch.float64)
    lengths = torch.randint(1, WIDTH + 1, (ROWS,), generator=generator)
    mask = (torch.arange(WIDTH)[None, :] < lengths[:, None]).to(torch.float64)

    theirs_logps = base.clone().requires_grad_(True)
    inputs = {
        "prompt_ids": torch.zeros(ROWS, 1, dtype=torch.long),
        "prompt_mask": torch.ones(ROWS, 1, dtype=torch.long),
        "completion_ids": torch.zeros(ROWS, WIDTH, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": reference,
        "num_items_in_batch": mask.sum(),
    }
    theirs = GRPOTrainer._compute_loss(stand_in(settings, theirs_logps), None, inputs)
    theirs.backward()

    ours_logps = base.clone().requires_grad_(True)
    batch = {
        "loss_mask": mask,
        "advantages": advantages,
        "old_logps": old,
        "ref_logps": reference,
    }
    total, divisor, _ = grpo_loss(settings, batch, -ours_logps)
    ours = total / divisor.to(total)
    ours.backward()
    assert theirs_logps.grad is not None and ours_logps.grad is not None
    return {
        "loss": float((ours - theirs).detach().abs()),
        "grad": float((ours_logps.grad - theirs_logps.grad).abs().max()),
        "magnitude": float(theirs.detach().abs()),
    }


def main() -> None:
    report = {}
    for loss_type in ("dapo", "grpo", "dr_grpo"):
        for beta, high in ((0.0, 0.2), (0.04, 0.28)):
            settings = GrpoSettings(
                loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=high,
                max_completion_length=WIDTH,
            )  # fmt: skip
            report[f"{loss_type} beta={beta} epsilon_high={high}"] = compare(settings, seed=3)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
