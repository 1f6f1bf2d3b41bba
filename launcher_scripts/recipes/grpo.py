"""What the grpo stage's recipe asks of its rollouts, rewards and loss (`model.grpo`), read and
checked before any job.

    model.grpo.num_generations        completions sampled per prompt (a group), >= 2
    model.grpo.max_completion_length  new tokens per completion at most
    model.grpo.temperature, top_k, top_p   the rollouts' sampling
    model.grpo.beta                   KL penalty to the reference (0: none, no reference held)
    model.grpo.epsilon, epsilon_high  the ratio's clip range [1 - epsilon, 1 + epsilon_high]
    model.grpo.num_iterations         optimizer steps per rollout batch (mu)
    model.grpo.loss_type              dapo | grpo | dr_grpo: how token losses are averaged
    model.grpo.scale_rewards          group | batch | none: what advantages are divided by
    model.grpo.mask_truncated_completions   leave completions cut at the length out of the loss
    model.grpo.reward_functions       ["module:function", {function, weight, kwargs}, or a
                                      reward model: {reward_model: RM.nemo, weight, normalize}]

The global batch is completions: `global_batch_size / num_generations` prompts per step. The
names and defaults are TRL's GRPOConfig's, so a TRL recipe reads across.

Pure Python: the launcher's preflight and the job program read it.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher_scripts.errors import RecipeError

LOSS_TYPES = ("dapo", "grpo", "dr_grpo")
SCALINGS = ("group", "batch", "none")
GRPO_KEYS = (
    "num_generations",
    "max_completion_length",
    "temperature",
    "top_k",
    "top_p",
    "beta",
    "epsilon",
    "epsilon_high",
    "num_iterations",
    "loss_type",
    "scale_rewards",
    "mask_truncated_completions",
    "reward_functions",
)


@dataclass(frozen=True)
class RewardFunction:
    """A reward: `module:function`, called as function(prompt, completion, **fields of the
    example, **kwargs) and returning a number; the rewards of a completion are summed with
    their weights."""

    path: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.rsplit(":", 1)[1]

    def load(self) -> Callable[..., Any]:
        module, name = self.path.split(":")
        return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class RewardModel:
    """A reward model the rlhf_rm stage wrote: a completion's reward is its value at the
    completion's last token (prompt and completion as the policy's token ids: the two share a
    tokenizer), standardised with the file's validation mean and std when `normalize`."""

    path: Path
    weight: float = 1.0
    normalize: bool = True
    key: str = ""  # the recipe key naming the file, for messages

    @property
    def name(self) -> str:
        return "reward_model"


@dataclass(frozen=True)
class GrpoSettings:
    num_generations: int = 8
    max_completion_length: int = 32
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    num_iterations: int = 1
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    mask_truncated_completions: bool = False
    rewards: tuple[RewardFunction | RewardModel, ...] = ()

    def prompts_per_step(self, global_batch_size: int) -> int:
        return global_batch_size // self.num_generations

    def reward_models(self) -> list[tuple[str, Path]]:
        """(recipe key, path) of the reward models it scores with: each must be a reward model
        holding the base's tokenizer."""
        return [(r.key, r.path) for r in self.rewards if isinstance(r, RewardModel)]


def read_grpo(cfg: Any, stage: str) -> GrpoSettings:
    section = cfg.model.get("grpo") or {}
    key = f"{stage}.model.grpo"
    unknown = sorted(set(section) - set(GRPO_KEYS))
    if unknown:
        raise RecipeError(f"{key}: {unknown} are not settings of it; it reads {list(GRPO_KEYS)}")
    groups = number(section, "num_generations", 8, int, key)
    if groups < 2:
        raise RecipeError(
            f"{key}.num_generations: {groups}; a group needs 2 or more completions (its rewards "
            "are compared with each other's): 8 is usual"
        )
    gbs = int(cfg.model.get("global_batch_size") or 0)
    if gbs % groups:
        raise RecipeError(
            f"{stage}.model.global_batch_size: {gbs} completions do not make whole groups of "
            f"{key}.num_generations={groups}: give a multiple of {groups}"
        )
    length = number(section, "max_completion_length", 32, int, key)
    if length < 1:
        raise RecipeError(f"{key}.max_completion_length: {length} must be 1 or more")
    temperature, top_k, top_p = read_sampling(section, key)
    beta = number(section, "beta", 0.0, float, key)
    if beta < 0:
        raise RecipeError(f"{key}.beta: {beta} must be 0 (no KL penalty) or more")
    epsilon = number(section, "epsilon", 0.2, float, key)
    high = section.get("epsilon_high")
    epsilon_high = epsilon if high is None else number(section, "epsilon_high", 0.2, float, key)
    if not 0 < epsilon < 1 or epsilon_high <= 0:
        raise RecipeError(
            f"{key}: epsilon {epsilon} must be in (0, 1) and epsilon_high {epsilon_high} above 0"
        )
    iterations = number(section, "num_iterations", 1, int, key)
    if iterations < 1:
        raise RecipeError(f"{key}.num_iterations: {iterations} must be 1 or more")
    loss_type = str(section.get("loss_type") or "dapo")
    if loss_type not in LOSS_TYPES:
        raise RecipeError(f"{key}.loss_type: {loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
    scale = str(section.get("scale_rewards") or "group")
    if scale not in SCALINGS:
        raise RecipeError(f"{key}.scale_rewards: {scale!r} is not one of {', '.join(SCALINGS)}")
    return GrpoSettings(
        num_generations=groups,
        max_completion_length=length,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        beta=beta,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        num_iterations=iterations,
        loss_type=loss_type,
        scale_rewards=scale,
        mask_truncated_completions=bool(section.get("mask_truncated_completions", False)),
        rewards=read_rewards(section.get("reward_functions"), f"{key}.reward_functions"),
    )


def read_sampling(section: Any, key: str) -> tuple[float, int, float]:
    """The rollouts' temperature (above 0: they are sampled), top_k and top_p."""
    temperature = number(section, "temperature", 1.0, float, key)
    if not temperature > 0:
        raise RecipeError(
            f"{key}.temperature: {temperature}; rollouts are sampled: give a temperature above 0"
        )
    top_k = number(section, "top_k", 0, int, key)
    top_p = number(section, "top_p", 1.0, float, key)
    if top_k < 0 or not 0 < top_p <= 1:
        raise RecipeError(f"{key}: top_k {top_k} must be >= 0 and top_p {top_p} in (0, 1]")
    return temperature, top_k, top_p


def read_rewards(listed: Any, key: str) -> tuple[RewardFunction | RewardModel, ...]:
    """The reward functions, each found and callable where the launcher runs (the job imports
    them alike), and reward models."""
    if not listed:
        raise RecipeError(
            f"{key}: give at least one reward function, e.g. "
            "[launcher_scripts.recipes.rewards:exact_answer]"
        )
    if isinstance(listed, str) or not isinstance(listed, (list, tuple)) and not _is_list(listed):
        raise RecipeError(f"{key}: {listed!r}: give a list of reward functions")
    rewards: list[RewardFunction | RewardModel] = []
    for index, entry in enumerate(listed):
        where = f"{key}[{index}]"
        if isinstance(entry, str):
            entry = {"function": entry}
        if hasattr(entry, "get") and entry.get("reward_model"):
            rewards.append(_reward_model(entry, where))
            continue
        if not hasattr(entry, "get") or not entry.get("function"):
            raise RecipeError(
                f"{where}: {entry!r}: give 'module:function', {{function, weight, kwargs}} or "
                "{reward_model: RM.nemo, weight, normalize}"
            )
        extra = sorted(set(entry) - {"function", "weight", "kwargs"})
        if extra:
            raise RecipeError(
                f"{where}: {extra} are not keys of a reward: function, weight, kwargs"
            )
        reward = RewardFunction(
            str(entry["function"]),
            float(entry.get("weight", 1.0)),
            dict(entry.get("kwargs") or {}),
        )
        _check_callable(reward, f"{where}.function")
        rewards.append(reward)
    return tuple(rewards)


def _reward_model(entry: Any, where: str) -> RewardModel:
    extra = sorted(set(entry) - {"reward_model", "weight", "normalize"})
    if extra:
        raise RecipeError(
            f"{where}: {extra} are not keys of a reward model: reward_model, weight, normalize"
        )
    normalize = entry.get("normalize", True)
    if not isinstance(normalize, bool):
        raise RecipeError(f"{where}.normalize: {normalize!r} must be true or false")
    return RewardModel(
        Path(str(entry["reward_model"])),
        float(entry.get("weight", 1.0)),
        normalize,
        f"{where}.reward_model",
    )


def _is_list(value: Any) -> bool:
    try:
        return not isinstance(value, (str, bytes, dict)) and iter(value) is not None
    except TypeError:
        return False


def _check_callable(reward: RewardFunction, key: str) -> None:
    module, _, name = reward.path.partition(":")
    if not module or not name or ":" in name:
        raise RecipeError(f"{key}: {reward.path!r}: name it as module:function")
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise RecipeError(
            f"{key}: module {module!r} is not importable here: put its folder on PYTHONPATH "
            "(the job imports it alike)"
        )
    try:
        function = reward.load()
    except Exception as error:  # noqa: BLE001 - the user's module: say what it raised
        raise RecipeError(
            f"{key}: importing {reward.path} failed: {type(error).__name__}: {error}"
        ) from None
    if not callable(function):
        raise RecipeError(f"{key}: {reward.path} is a {type(function).__name__}, not a function")


def number(section: Any, name: str, default: Any, kind: type, key: str) -> Any:
    value = section.get(name, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecipeError(f"{key}.{name}: {value!r} is not a number")
    if kind is int and value != int(value):
        raise RecipeError(f"{key}.{name}: {value!r} must be a whole number")
    return kind(value)
