"""The PPO tests' shared settings: the stage's overrides for the tiny models, the short run, the
servers layout, and what a run's files say."""

from __future__ import annotations

from pathlib import Path

from tests.support import REPO

STAGE = "rlhf_ppo"
TRAIN = REPO / "launcher_scripts" / "sample_data" / "preference_train.jsonl"
CONSTANT_LR = (
    f"{STAGE}.model.optim.sched.min_lr=5e-4",
    f"{STAGE}.model.optim.sched.warmup_steps=0",
)
NO_VALIDATION = (
    f"{STAGE}.trainer.val_check_interval=100",
    f"{STAGE}.model.data.data_prefix.validation=null",
)


def reward_model(results: Path) -> Path:
    return results / "checkpoints" / "megatron_gpt_reward_model.nemo"


def overrides(results: Path, base: Path, scorer: Path, *extra: str) -> list[str]:
    return [
        f"stages=[{STAGE}]",
        f"base_results_dir={results}",
        f"{STAGE}.model.pretrained_checkpoint.restore_from_path={base}",
        f"{STAGE}.model.rlhf.reward_model.restore_from_path={scorer}",
        *extra,
    ]


SHORT = (
    *CONSTANT_LR,
    *NO_VALIDATION,
    f"{STAGE}.model.rlhf.ppo.entropy_bonus=0.01",  # the entropy's gradient over TP ranks too
    f"{STAGE}.trainer.max_steps=4",
    f"{STAGE}.trainer.log_every_n_steps=2",
)
SERVED = (f"{STAGE}.model.rlhf.layout=servers",)
ROLES = ("reward_model", "initial_policy", "critic")


def metric_lines(results: Path) -> bool:
    path = results / "metrics.jsonl"
    return path.is_file() and '"value_loss"' in path.read_text()
