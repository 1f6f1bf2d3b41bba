"""What the rlhf_ppo stage's recipe asks of PPO's four roles (`model.rlhf`, reference 5.16.2),
read and checked before any job.

    model.rlhf.reward_model.restore_from_path   the rlhf_rm stage's reward model
    model.rlhf.reward_model.normalize           standardise its scores with the file's mean/std
    model.rlhf.critic.restore_from_path         the critic's start (null: the reward model)
    model.rlhf.critic.optim                     the critic's optimizer, over model.optim's
    model.rlhf.ppo.num_rollout_samples          completions sampled per rollout batch
    model.rlhf.ppo.epochs                       passes over each rollout batch, in
                                                global_batch_size mini-batches (a step each)
    model.rlhf.ppo.max_completion_length, temperature, top_k, top_p   the rollouts' sampling
    model.rlhf.ppo.initial_policy_kl_penalty    the KL penalty's coefficient (its start when
                                                adaptive)
    model.rlhf.ppo.use_absolute_kl              |log pi - log pi_init| per token
    model.rlhf.ppo.kl_target, kl_horizon        adaptive KL: the coefficient follows the KL
                                                towards kl_target (null: fixed)
    model.rlhf.ppo.entropy_bonus                the entropy term's weight in the actor's loss
    model.rlhf.ppo.ratio_eps                    the ratio's clip range [1 - eps, 1 + eps]
    model.rlhf.ppo.discount, gae_lambda         GAE's gamma and lambda
    model.rlhf.ppo.normalize_advantage          whiten the advantages over the rollout batch
    model.rlhf.ppo.critic_loss_clip_value       the value loss's clip around the rollout's
                                                values (0: no clip)

Pure Python: the launcher's preflight and the job program read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher_scripts.errors import RecipeError
from launcher_scripts.recipes.grpo import RewardModel, number, read_sampling

PPO_KEYS = (
    "num_rollout_samples",
    "epochs",
    "max_completion_length",
    "temperature",
    "top_k",
    "top_p",
    "initial_policy_kl_penalty",
    "use_absolute_kl",
    "kl_target",
    "kl_horizon",
    "entropy_bonus",
    "ratio_eps",
    "discount",
    "gae_lambda",
    "normalize_advantage",
    "critic_loss_clip_value",
)
CRITIC_OPTIM_KEYS = ("lr", "weight_decay", "betas", "eps", "sched")
LAYOUTS = ("colocated", "servers")
SERVER_ROLES = ("reward_model", "initial_policy", "critic")
RLHF_KEYS = (
    "rlhf.layout",
    *(f"rlhf.{role}.devices" for role in SERVER_ROLES),
    "rlhf.reward_model.restore_from_path",
    "rlhf.reward_model.normalize",
    "rlhf.critic.restore_from_path",
    *(f"rlhf.critic.optim.{name}" for name in CRITIC_OPTIM_KEYS),
    *(f"rlhf.ppo.{name}" for name in PPO_KEYS),
)


@dataclass(frozen=True)
class PpoSettings:
    reward: RewardModel
    critic: Path  # the critic's starting weights: a reward model's file
    critic_key: str
    critic_optim: dict[str, Any]  # over model.optim
    num_rollout_samples: int = 64
    epochs: int = 1
    max_completion_length: int = 32
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    initial_policy_kl_penalty: float = 0.02
    use_absolute_kl: bool = True
    kl_target: float | None = None
    kl_horizon: int = 10000
    entropy_bonus: float = 0.0
    ratio_eps: float = 0.2
    discount: float = 1.0
    gae_lambda: float = 0.95
    normalize_advantage: bool = True
    critic_loss_clip_value: float = 0.2
    layout: str = "colocated"  # or servers: the other roles as jobs of their own
    # Processes per server (servers layout), by role: each server's ranks hold its model.
    server_devices: dict[str, int] = field(default_factory=dict)

    @property
    def rewards(self) -> tuple[RewardModel, ...]:
        return (self.reward,)

    def served(self) -> list[tuple[str, int]]:
        """(role, processes) of the roles that run as servers beside the actor's job."""
        if self.layout != "servers":
            return []
        return [(role, self.server_devices.get(role, 1)) for role in SERVER_ROLES]

    def reward_models(self) -> list[tuple[str, Path]]:
        """(recipe key, path) of the reward-model files it reads (the reward model and the
        critic's start): each must be one, holding the base's tokenizer."""
        found = [(self.reward.key, self.reward.path)]
        if self.critic != self.reward.path:
            found.append((self.critic_key, self.critic))
        return found


def read_ppo(cfg: Any, stage: str) -> PpoSettings:
    rlhf = cfg.model.get("rlhf") or {}
    key = f"{stage}.model.rlhf"
    unknown = sorted(set(rlhf) - {"layout", "reward_model", "initial_policy", "critic", "ppo"})
    if unknown:
        raise RecipeError(
            f"{key}: {unknown} are not settings of it: layout, reward_model, initial_policy, "
            "critic, ppo"
        )
    layout = str(rlhf.get("layout") or "colocated")
    if layout not in LAYOUTS:
        raise RecipeError(f"{key}.layout: {layout!r} is not one of {', '.join(LAYOUTS)}")
    devices = {}
    for role in SERVER_ROLES:
        section = rlhf.get(role) or {}
        devices[role] = number(section, "devices", 1, int, f"{key}.{role}")
        if devices[role] < 1:
            raise RecipeError(f"{key}.{role}.devices: {devices[role]} must be 1 or more")
    extra = sorted(set(rlhf.get("initial_policy") or {}) - {"devices"})
    if extra:
        raise RecipeError(f"{key}.initial_policy: {extra} are not settings of it: devices")
    reward = _reward_model(rlhf.get("reward_model") or {}, f"{key}.reward_model")
    critic_section = rlhf.get("critic") or {}
    extra = sorted(set(critic_section) - {"restore_from_path", "optim", "devices"})
    if extra:
        raise RecipeError(
            f"{key}.critic: {extra} are not settings of it: restore_from_path, optim, devices"
        )
    critic = critic_section.get("restore_from_path")
    optim = dict(critic_section.get("optim") or {})
    extra = sorted(set(optim) - set(CRITIC_OPTIM_KEYS))
    if extra:
        raise RecipeError(
            f"{key}.critic.optim: {extra} are not settings of it: {', '.join(CRITIC_OPTIM_KEYS)}"
            " (the rest is model.optim's)"
        )
    if "lr" in optim and not float(optim["lr"]) > 0:
        raise RecipeError(f"{key}.critic.optim.lr: {optim['lr']} must be above 0")
    ppo = rlhf.get("ppo") or {}
    ppo_key = f"{key}.ppo"
    unknown = sorted(set(ppo) - set(PPO_KEYS))
    if unknown:
        raise RecipeError(f"{ppo_key}: {unknown} are not settings of it; it reads {list(PPO_KEYS)}")
    gbs = int(cfg.model.get("global_batch_size") or 0)
    samples = number(ppo, "num_rollout_samples", gbs, int, ppo_key)
    if samples < 1 or samples % max(gbs, 1):
        raise RecipeError(
            f"{ppo_key}.num_rollout_samples: {samples} is not a multiple of "
            f"{stage}.model.global_batch_size={gbs} (each optimizer step trains on one "
            f"global batch of the rollouts): give {gbs}, {2 * gbs}..."
        )
    epochs = number(ppo, "epochs", 1, int, ppo_key)
    length = number(ppo, "max_completion_length", 32, int, ppo_key)
    if epochs < 1 or length < 1:
        raise RecipeError(
            f"{ppo_key}: epochs {epochs} and max_completion_length {length} must be 1 or more"
        )
    temperature, top_k, top_p = read_sampling(ppo, ppo_key)
    penalty = number(ppo, "initial_policy_kl_penalty", 0.02, float, ppo_key)
    if penalty < 0:
        raise RecipeError(f"{ppo_key}.initial_policy_kl_penalty: {penalty} must be 0 or more")
    target = ppo.get("kl_target")
    if target is not None:
        target = number(ppo, "kl_target", 0.0, float, ppo_key)
        if not target > 0:
            raise RecipeError(
                f"{ppo_key}.kl_target: {target}; the adaptive penalty steers the KL towards "
                "it, so it must be above 0 (e.g. 0.1), or null for a fixed penalty"
            )
        if not penalty > 0:
            raise RecipeError(
                f"{ppo_key}.initial_policy_kl_penalty: an adaptive penalty (kl_target) "
                "scales its starting value, so give one above 0 (e.g. 0.02)"
            )
    horizon = number(ppo, "kl_horizon", 10000, int, ppo_key)
    if horizon < 1:
        raise RecipeError(f"{ppo_key}.kl_horizon: {horizon} must be 1 or more")
    entropy = number(ppo, "entropy_bonus", 0.0, float, ppo_key)
    clip = number(ppo, "critic_loss_clip_value", 0.2, float, ppo_key)
    if entropy < 0 or clip < 0:
        raise RecipeError(
            f"{ppo_key}: entropy_bonus {entropy} and critic_loss_clip_value {clip} must be 0 "
            "or more"
        )
    eps = number(ppo, "ratio_eps", 0.2, float, ppo_key)
    if not 0 < eps < 1:
        raise RecipeError(f"{ppo_key}.ratio_eps: {eps} must be in (0, 1)")
    discount = number(ppo, "discount", 1.0, float, ppo_key)
    lam = number(ppo, "gae_lambda", 0.95, float, ppo_key)
    if not (0 <= discount <= 1 and 0 <= lam <= 1):
        raise RecipeError(f"{ppo_key}: discount {discount} and gae_lambda {lam} must be in [0, 1]")
    return PpoSettings(
        reward=reward,
        critic=Path(str(critic)) if critic else reward.path,
        critic_key=f"{key}.critic.restore_from_path",
        critic_optim=optim,
        num_rollout_samples=samples,
        epochs=epochs,
        max_completion_length=length,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        initial_policy_kl_penalty=penalty,
        use_absolute_kl=_flag(ppo, "use_absolute_kl", True, ppo_key),
        kl_target=target,
        kl_horizon=horizon,
        entropy_bonus=entropy,
        ratio_eps=eps,
        discount=discount,
        gae_lambda=lam,
        normalize_advantage=_flag(ppo, "normalize_advantage", True, ppo_key),
        critic_loss_clip_value=clip,
        layout=layout,
        server_devices=devices,
    )


def _reward_model(section: Any, key: str) -> RewardModel:
    extra = sorted(set(section) - {"restore_from_path", "normalize", "devices"})
    if extra:
        raise RecipeError(
            f"{key}: {extra} are not settings of it: restore_from_path, normalize, devices"
        )
    path = section.get("restore_from_path")
    if not path:
        raise RecipeError(
            f"{key}.restore_from_path: give the reward model (the .nemo file the rlhf_rm "
            "stage writes)"
        )
    return RewardModel(
        Path(str(path)),
        1.0,
        _flag(section, "normalize", True, key),
        f"{key}.restore_from_path",
    )


def _flag(section: Any, name: str, default: bool, key: str) -> bool:
    value = section.get(name, default)
    if not isinstance(value, bool):
        raise RecipeError(f"{key}.{name}: {value!r} must be true or false")
    return value
