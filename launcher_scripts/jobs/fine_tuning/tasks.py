"""The training task each tuning stage runs, by the name its spec gives (TuningStageSpec.task
in recipes/tuning.py)."""

from __future__ import annotations

from launcher_scripts.jobs.fine_tuning.dpo import DpoTask
from launcher_scripts.jobs.fine_tuning.grpo import GrpoTask
from launcher_scripts.jobs.fine_tuning.ppo import PpoTask
from launcher_scripts.jobs.fine_tuning.reward_model import RewardModelTask
from launcher_scripts.jobs.fine_tuning.tuner import TuningTask

TASKS: dict[str, type[TuningTask]] = {
    "sft": TuningTask,
    "reward_model": RewardModelTask,
    "dpo": DpoTask,
    "grpo": GrpoTask,
    "ppo": PpoTask,
}
