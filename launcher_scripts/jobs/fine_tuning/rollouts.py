"""What the online tuning stages (grpo, rlhf_ppo) share: training on completions the policy
itself samples (rollouts).

A rollout batch is made every `steps_per_rollout()` optimizer steps: the task takes the next
prompts of the shuffled prompt files, samples `completions_per_prompt()` completions of each
with the KV-cache engine (the data-parallel replicas each sample a share, every rank of a
replica the same tokens) and scores each with the recipe's rewards (functions, or reward models
built beside the policy). The task's `prepare` turns the scored rollouts into the training
samples of the batch (advantages, the sampling policy's log-probabilities...), which the
optimizer steps of the batch read in the order `sample_order` gives.

Everything a rollout depends on is a function of the batch's number, the seed and the weights,
so a resumed run samples what the uninterrupted one did; a rollout batch trained on over
several steps is saved beside each checkpoint (rollouts.pt). Validation answers the held-out
prompts greedily and reports their mean reward; the curves are plotted at the end.

The task's settings (`spec.objective`) give the sampling: max_completion_length, temperature,
top_k, top_p, and `rewards` (recipes.grpo's RewardFunction and RewardModel).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from launcher_scripts.files import write_atomic
from launcher_scripts.formats.prompt import as_prompt_record, prompt_problem
from launcher_scripts.jobs.fine_tuning.answers import write_jsonl
from launcher_scripts.jobs.fine_tuning.preference_data import (
    chat_template,
    epoch_order,
    prompt_text,
)
from launcher_scripts.jobs.fine_tuning.sft_data import SftDataError, json_lines
from launcher_scripts.jobs.fine_tuning.tuner import TuningTask, bare_chunks
from launcher_scripts.jobs.inference.generation import Completion, generate
from launcher_scripts.jobs.training import data, metrics
from launcher_scripts.jobs.training.runtime import JobError
from launcher_scripts.jobs.training.trainer import Streams, Trainer
from launcher_scripts.recipes.generation_params import MAX_SEED, GenerationParams
from launcher_scripts.recipes.grpo import RewardFunction, RewardModel

# A training sample's keys every online task has (the tasks add theirs).
SAMPLE_KEYS = ("tokens", "position_ids", "labels", "loss_mask")


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str  # what the reward functions get: the prompt as the model read it
    fields: dict[str, Any]  # the record's other keys, handed to the reward functions
    where: str  # file:line


@dataclass
class Rollout:
    """One sampled completion of a prompt, scored."""

    prompt: int  # index into the split's prompts
    completion: list[int]  # with the end-of-document token when the model ended it
    text: str
    truncated: bool  # cut at max_completion_length
    rewards: list[float]  # one per reward
    reward: float = 0.0  # their weighted sum


@dataclass
class RolloutBatch:
    """The samples of the rollout batch being trained on, read as the training stream's
    dataset: global sample `start + i` is sample `order[i]` (i counting the batch's steps'
    samples in turn)."""

    samples: list[dict[str, torch.Tensor]] = field(default_factory=list)
    order: list[int] = field(default_factory=list)
    start: int = 0
    length: int = 1

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.samples[self.order[(index - self.start) % len(self.order)]]


def load_prompts(
    files: Sequence[Path], tokenizer: Any, template: str | None, limit: int, length_key: str
) -> list[Prompt]:
    """The split's prompt records, encoded; a prompt of more than `limit` tokens (what the
    sequence leaves after the longest completion) stops the run naming its line."""
    prompts = []
    for path in files:
        for where, line in json_lines(path):
            record = as_prompt_record(line)
            problem = prompt_problem(record)
            if problem is not None:
                raise SftDataError(f"{where}: {problem}")
            text = prompt_text(record["prompt"], template)
            ids = tokenizer.encode(text)
            if len(ids) > limit:
                raise SftDataError(
                    f"{where}: the prompt is {len(ids)} tokens, and the sequence leaves "
                    f"{limit} after max_completion_length: raise model.data.seq_length, lower "
                    f"{length_key} or leave the record out"
                )
            fields = {k: v for k, v in record.items() if k != "prompt"}
            prompts.append(Prompt(ids, text, fields, where))
    return prompts


class FunctionScorer:
    """A reward function, called once per completion."""

    def __init__(self, reward: RewardFunction, key: str) -> None:
        self.reward, self.function, self.key = reward, reward.load(), key

    def scores(self, prompts: Sequence[Prompt], completions: Sequence[Completion]) -> list[float]:
        return [self.score(p, c.text) for p, c in zip(prompts, completions, strict=True)]

    def score(self, prompt: Prompt, text: str) -> float:
        """JobError naming the function and the record when it raises or returns anything but
        a finite number."""
        path = self.reward.path
        try:
            value = self.function(prompt.text, text, **prompt.fields, **self.reward.kwargs)
        except Exception as error:  # noqa: BLE001 - the user's function: say what it raised
            raise JobError(
                f"{self.key}: {path} raised {type(error).__name__}: {error} "
                f"(scoring {prompt.where}): fix the function"
            ) from None
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise JobError(
                f"{self.key}: {path} returned {value!r} scoring "
                f"{prompt.where}: a reward function returns a finite number"
            )
        return float(value)


def scored_rows(
    prompts: Sequence[Prompt], completions: Sequence[Completion], eod: int
) -> list[list[int]]:
    """What a reward model scores: each prompt's ids and its completion's tokens, without the
    end-of-document token (the score is read at the row's last token)."""
    return [
        p.ids + [t for t in c.tokens if t != eod] for p, c in zip(prompts, completions, strict=True)
    ]


class ModelScorer:
    """A reward model built beside the policy in its TP/PP layout (every rank of a replica
    scores the same rows): a completion's reward is the model's value at its last token, after
    the prompt, without the end-of-document token (as the reward model was trained)."""

    BATCH = 64

    def __init__(self, reward: RewardModel, trainer: Trainer, tokenizer: Any) -> None:
        from launcher_scripts.formats import portable
        from launcher_scripts.formats.portable import REWARD_MODEL
        from launcher_scripts.jobs.conversion import load
        from launcher_scripts.jobs.inference.runner import ModelRunner

        self.reward, self.eod = reward, tokenizer.eod_id
        loaded = portable.read(reward.path, trainer.log_dir, extract=False)
        chunks = load.build(loaded, trainer.layout.tensor, trainer.layout.pipeline, trainer.on_gpu)
        section = loaded.config[REWARD_MODEL]
        self.mean, self.std = float(section.mean), max(float(section.std), 1e-6)
        self.runner = ModelRunner(
            chunks=chunks,
            tokenizer=tokenizer,
            max_length=int(loaded.config.max_position_embeddings),
            vocab_size=1,
            tensor=trainer.layout.tensor,
            pipeline=trainer.layout.pipeline,
            on_gpu=trainer.on_gpu,
            scalar=True,
        )
        trainer.say(f"reward model {reward.path}: mean {self.mean:.3f}, std {self.std:.3f}")

    def scores(self, prompts: Sequence[Prompt], completions: Sequence[Completion]) -> list[float]:
        rows = scored_rows(prompts, completions, self.eod)
        values: list[float] = []
        for start in range(0, len(rows), self.BATCH):
            batch = rows[start : start + self.BATCH]
            found = self.runner.logits(batch)[..., 0]
            last = torch.tensor([len(row) - 1 for row in batch])
            values += found[torch.arange(len(batch)), last].tolist()
        if self.reward.normalize:
            values = [(value - self.mean) / self.std for value in values]
        return values


def logps_report(batch: dict[str, torch.Tensor], output: torch.Tensor) -> tuple[Any, Any, Any]:
    """A forward-only pass's per-token log-probabilities of the labels ([mbs, seq])."""
    del batch
    logps = -output.float().detach()
    return logps.new_zeros(()), torch.ones((), dtype=torch.int), {"logps": logps}


class RolloutTask(TuningTask):
    """The online tasks' base: the hooks a task fills in are below the first section."""

    settings_key = ""  # the recipe section of the task's settings, for messages
    curves_file = ""  # the plot write_outputs draws

    def __init__(self, cfg: Any, spec: Any, base: Any) -> None:
        super().__init__(cfg, spec, base)
        self.settings = spec.objective
        self.scorers: list[FunctionScorer | ModelScorer] = []
        self.batch = RolloutBatch()
        self.rollouts: list[Rollout] = []
        self.rollout_stats: dict[str, float] = {}  # what the task measured of the batch
        self.generation_seconds = 0.0
        self.cycle = -1  # the rollout batch held: that of steps from cycle x steps_per_rollout
        self.mode = "train"  # or "logps": the forward step reports log-probabilities
        self.starting_values: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._orders: dict[int, list[int]] = {}  # the training prompts' order, by epoch

    # ----- what a task gives ------------------------------------------------------------

    def completions_per_prompt(self) -> int:
        raise NotImplementedError

    def rollout_size(self, trainer: Trainer) -> int:
        """Completions per rollout batch."""
        raise NotImplementedError

    def steps_per_rollout(self, trainer: Trainer) -> int:
        raise NotImplementedError

    def uses_reference(self) -> bool:
        """Whether the task asks the starting policy's log-probabilities (a KL term)."""
        raise NotImplementedError

    def prepare(self, trainer: Trainer, rollouts: list[Rollout]) -> None:
        """The scored rollouts into the batch's samples (`self.batch.samples`, from
        `self.sample(rollout)`), on every rank alike."""
        raise NotImplementedError

    def sample_order(self, trainer: Trainer, cycle: int) -> list[int]:
        """The samples the batch's optimizer steps read in turn (one global batch a step)."""
        del cycle
        return list(range(len(self.batch.samples))) * self.steps_per_rollout(trainer)

    # ----- model ------------------------------------------------------------------------

    def make_chunks(self, trainer: Trainer) -> list[Any]:
        """The policy; with a reference its trainable weights' starting values are kept: the
        reference is the starting policy (LoRA's: the base, its adapters at their start)."""
        chunks = super().make_chunks(trainer)
        if self.uses_reference():
            self.starting_values = [
                (p, p.detach().clone()) for c in chunks for p in c.parameters() if p.requires_grad
            ]
        return chunks

    # ----- data -------------------------------------------------------------------------

    def build_data(self, trainer: Trainer) -> Streams:
        template = chat_template(self.base.config.get("tokenizer"))
        limit = self.seq_length - self.settings.max_completion_length
        splits = {"train": self.spec.train, "validation": self.spec.validation}
        splits["test"] = self.spec.test
        labels = {"train": "training data", "validation": "validation data", "test": "test data"}
        length_key = f"{self.settings_key}.max_completion_length"
        self.prompts = {}
        for name, split in splits.items():
            if split is None:
                continue
            found = load_prompts(split.files, self.tokenizer, template, limit, length_key)
            if not found:
                raise SftDataError(f"{labels[name]}: the files hold no prompt records")
            self.prompts[name] = found
        per_prompt = self.completions_per_prompt()
        trainer.say(
            "prompts: "
            + ", ".join(f"{len(p)} {name}" for name, p in self.prompts.items())
            + f"; {self.rollout_size(trainer) // per_prompt} prompts per rollout batch, "
            + f"{per_prompt} completion{'s' if per_prompt > 1 else ''} each, "
            + f"{self.steps_per_rollout(trainer)} optimizer step(s) on each batch"
        )
        self.scorers = self.make_scorers(trainer)
        model = trainer.cfg.model
        self.batch.length = int(trainer.cfg.trainer.max_steps) * int(model.global_batch_size)
        train = data.SampleStream(self.batch, int(model.micro_batch_size), self.sample_keys())
        return Streams(train, None, 0)

    def make_scorers(self, trainer: Trainer) -> list[Any]:
        """One scorer per reward of the settings: a function, or a reward model built here."""
        return [
            ModelScorer(r, trainer, self.tokenizer)
            if isinstance(r, RewardModel)
            else FunctionScorer(r, f"{self.settings_key}.reward_functions")
            for r in self.settings.rewards
        ]

    def sample_keys(self) -> tuple[str, ...]:
        raise NotImplementedError

    def _prompt_order(self, trainer: Trainer, cycle: int) -> list[int]:
        """The prompts of a rollout batch: the next ones of the training prompts shuffled anew
        each epoch (by the seed), so the order depends on the batch's number only."""
        count = self.rollout_size(trainer) // self.completions_per_prompt()
        prompts = len(self.prompts["train"])
        chosen = []
        for position in range(cycle * count, (cycle + 1) * count):
            epoch, index = divmod(position, prompts)
            if epoch not in self._orders:  # epochs are read in turn: keep the latest
                self._orders = {epoch: epoch_order(prompts, trainer.seed, epoch)}
            chosen.append(self._orders[epoch][index])
        return chosen

    # ----- rollouts ---------------------------------------------------------------------

    def before_step(self, trainer: Trainer) -> None:
        steps = self.steps_per_rollout(trainer)
        cycle = trainer.state.step // steps
        if cycle == self.cycle:
            return
        if not self._read_saved(trainer, cycle):
            self._roll_out(trainer, cycle)
        self.batch.order = self.sample_order(trainer, cycle)
        self.batch.start = cycle * steps * int(trainer.cfg.model.global_batch_size)
        self.cycle = cycle

    def _roll_out(self, trainer: Trainer, cycle: int) -> None:
        settings = self.settings
        tick = time.perf_counter()
        order = self._prompt_order(trainer, cycle)
        wanted = [index for index in order for _ in range(self.completions_per_prompt())]
        params = GenerationParams(
            tokens_to_generate=settings.max_completion_length,
            temperature=settings.temperature,
            top_k=settings.top_k,
            top_p=0.0 if settings.top_p >= 1.0 else settings.top_p,
            random_seed=(trainer.seed * 7919 + cycle) % MAX_SEED,
        )
        scored = self._generate(trainer, "train", wanted, params)
        self.generation_seconds = time.perf_counter() - tick
        rollouts = []
        for index, (completion, scores) in zip(wanted, scored, strict=True):
            ids = list(completion.tokens)
            if completion.finish_reason == "eod":
                ids.append(self.tokenizer.eod_id)
            total = self.weighted(scores)
            rollouts.append(
                Rollout(index, ids, completion.text, completion.finish_reason == "length",
                        scores, total)
            )  # fmt: skip
        self.rollouts = rollouts
        self.prepare(trainer, rollouts)

    def weighted(self, scores: Sequence[float]) -> float:
        return sum(s.reward.weight * value for s, value in zip(self.scorers, scores, strict=True))

    def _generate(
        self, trainer: Trainer, split: str, wanted: list[int], params: GenerationParams
    ) -> list[tuple[Completion, list[float]]]:
        """Completions of the split's prompts `wanted` (in order), each with its scores (one
        per reward): each data-parallel replica samples and scores a contiguous share (its own
        seed), then every rank has them all."""
        dp_size = parallel_state.get_data_parallel_world_size()
        dp_rank = parallel_state.get_data_parallel_rank()
        share = -(-len(wanted) // dp_size)
        mine = wanted[dp_rank * share : (dp_rank + 1) * share]
        if params.random_seed is not None:
            params = replace(params, random_seed=(params.random_seed + dp_rank) % MAX_SEED)
        made: list[tuple[Completion, list[float]]] = []
        if mine:
            decoding, tokenizer, limit = self.side.generation(
                trainer.cfg,
                bare_chunks(trainer),
                self.tokenizer,
                trainer.layout,
                trainer.on_gpu,
                [],
            )
            records = [self.prompts[split][index] for index in mine]
            with trainer.eval_mode():
                completions = generate(
                    decoding, tokenizer, [r.ids for r in records], params, max_length=limit
                )
            per_reward = [scorer.scores(records, completions) for scorer in self.scorers]
            made = [(c, [s[i] for s in per_reward]) for i, c in enumerate(completions)]
        if dp_size == 1:
            return made
        shares: list[Any] = [None] * dp_size
        dist.all_gather_object(shares, made, group=parallel_state.get_data_parallel_group())
        return [completion for piece in shares for completion in piece]

    def sample(self, rollout: Rollout, in_loss: bool = True) -> dict[str, torch.Tensor]:
        """A training sample: prompt then completion, the completion's tokens in the loss
        (none when not `in_loss`)."""
        prompt = self.prompts["train"][rollout.prompt].ids
        ids = prompt + rollout.completion
        seq, pad = self.seq_length, self.tokenizer.eod_id
        tokens = torch.full((seq,), pad, dtype=torch.long)
        tokens[: len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels = torch.full((seq,), pad, dtype=torch.long)
        labels[: len(ids) - 1] = tokens[1 : len(ids)]
        mask = torch.zeros(seq)
        if in_loss:
            mask[len(prompt) - 1 : len(ids) - 1] = 1.0
        return {
            "tokens": tokens,
            "position_ids": torch.arange(seq, dtype=torch.long),
            "labels": labels,
            "loss_mask": mask,
        }

    def attach_logps(self, trainer: Trainer, key: str) -> None:
        """Each rollout sample's per-token log-probabilities under the policy as it is now,
        computed forward only over the batch and given to every rank."""
        self.attach_rows(trainer, key, "logps")

    def attach_rows(
        self, trainer: Trainer, key: str, report: str, model: Any = None, forward: Any = None
    ) -> None:
        """Each rollout sample's row of a forward-only pass over the batch (the policy in
        "logps" mode, or another model with forward(batch, model)), from its micro-batches'
        `report`, as `key` on every rank."""
        samples = self.batch.samples
        model_cfg = trainer.cfg.model
        gbs, mbs = int(model_cfg.global_batch_size), int(model_cfg.micro_batch_size)
        self.mode = "logps"
        try:
            stream = data.SampleStream(samples, mbs, SAMPLE_KEYS)
            outputs = trainer.evaluate(stream, -(-len(samples) // gbs), model, forward)
        finally:
            self.mode = "train"
        rows = data.evaluated_rows(outputs, report, len(samples), mbs, gbs)
        assert rows is not None
        for index, values in enumerate(rows):
            samples[index][key] = values

    def _read_saved(self, trainer: Trainer, cycle: int) -> bool:
        """A resumed run's rollout batch, saved with the checkpoint, when it started before
        the checkpoint's step (its rollouts came from weights no longer held)."""
        steps = self.steps_per_rollout(trainer)
        if trainer.state.step % steps == 0:
            return False
        path = trainer.log_dir / "rollouts.pt"
        saved = torch.load(path, weights_only=False) if path.is_file() else None
        if saved is None or saved["cycle"] != cycle:
            raise JobError(
                f"{path}: the rollout batch of steps from {cycle * steps} is not there to "
                f"resume step {trainer.state.step} with: restore the file, or resume from a "
                f"checkpoint at the start of a rollout batch (a multiple of {steps} steps)"
            )
        self.rollouts, self.batch.samples = saved["rollouts"], saved["samples"]
        self.rollout_stats = saved["stats"]
        return True

    def on_checkpoint(self, trainer: Trainer) -> None:
        super().on_checkpoint(trainer)
        if self.steps_per_rollout(trainer) > 1 and self.batch.samples:
            path = trainer.log_dir / "rollouts.pt"
            scratch = path.with_name(path.name + ".tmp")
            state = {
                "cycle": self.cycle,
                "rollouts": self.rollouts,
                "samples": self.batch.samples,
                "stats": self.rollout_stats,
            }
            torch.save(state, scratch)
            scratch.replace(path)

    def fresh_rollouts(self, trainer: Trainer) -> bool:
        """Whether the step just taken was the first on its rollout batch."""
        return (trainer.state.step - 1) % self.steps_per_rollout(trainer) == 0

    def log_step(
        self, trainer: Trainer, record: dict[str, float], seconds: float, line: str
    ) -> None:
        """A step's metrics (with the share of its `seconds` spent sampling) into the log, and
        `line` at the recipe's log interval."""
        fresh = self.fresh_rollouts(trainer)
        record["generation_share"] = self.generation_seconds / seconds if fresh else 0.0
        trainer.record({"step": trainer.state.step, **record})
        if trainer.state.step % int(trainer.cfg.trainer.log_every_n_steps) == 0:
            trainer.say(f"step {trainer.state.step}: {line}")

    def rollout_metrics(self, rollouts: list[Rollout]) -> dict[str, float]:
        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float64)
        found = {
            "reward": float(rewards.mean()),
            "completion_length": sum(len(r.completion) for r in rollouts) / len(rollouts),
            "truncated_share": sum(r.truncated for r in rollouts) / len(rollouts),
        }
        for position, scorer in enumerate(self.scorers):
            found[f"rewards/{scorer.reward.name}"] = sum(
                r.rewards[position] for r in rollouts
            ) / len(rollouts)
        return found

    # ----- validation and outputs ---------------------------------------------------------

    def before_training(self, trainer: Trainer) -> None:
        """On a fresh start, the starting policy's held-out reward: the curve's first point."""
        if trainer.state.step == 0 and "validation" in self.prompts:
            trainer.validate()

    def after_validation(self, trainer: Trainer, loss: float, outputs: list[Any]) -> None:
        del loss, outputs
        if "validation" not in self.prompts:
            return
        scores, rows = self.answer(trainer, "validation")
        held_out = {f"validation_{name}": value for name, value in scores.items()}
        trainer.state.metrics.update(held_out)
        trainer.record({"step": trainer.state.step, **held_out})
        if trainer.rank == 0:
            write_jsonl(trainer.log_dir / "validation_completions.jsonl", rows)
        trainer.say(
            f"validation at step {trainer.state.step}: reward {scores['reward']:.3f} over "
            f"{len(rows)} held-out prompts (greedy)"
        )

    def answer(self, trainer: Trainer, split: str) -> tuple[dict[str, float], list[dict]]:
        """Greedy completions of every prompt of the split, their mean rewards (the weighted
        sum's, `reward`, and each reward's) and one row per prompt."""
        prompts = self.prompts[split]
        params = GenerationParams(tokens_to_generate=self.settings.max_completion_length, top_k=1)
        scored = self._generate(trainer, split, list(range(len(prompts))), params)
        rows, totals = [], [0.0] * len(self.scorers)
        weighted = 0.0
        for prompt, (completion, scores) in zip(prompts, scored, strict=True):
            total = self.weighted(scores)
            weighted += total
            totals = [a + b for a, b in zip(totals, scores, strict=True)]
            rows.append(
                {"source": prompt.where, "prompt": prompt.text, "completion": completion.text,
                 "reward": total, "rewards": scores}
            )  # fmt: skip
        count = len(prompts)
        scores = {"reward": weighted / count}
        for scorer, value in zip(self.scorers, totals, strict=True):
            scores[scorer.reward.name] = value / count
        return scores, rows

    def write_outputs(self, trainer: Trainer) -> None:
        self.write_model(trainer)
        if "test" in self.prompts:
            scores, rows = self.answer(trainer, "test")
            if trainer.rank == 0:
                write_jsonl(trainer.log_dir / "test_completions.jsonl", rows)
                path = trainer.log_dir / "test_metrics.json"
                write_atomic(path, json.dumps(scores, indent=2) + "\n")
                trainer.say(f"test set: reward {scores['reward']:.3f} over {len(rows)}; {path}")
        if trainer.rank == 0 and trainer.metrics_log is not None:
            output = trainer.log_dir / self.curves_file
            if plot_curves(trainer.metrics_log.path, output):
                trainer.say(f"reward curves: {output}")
        dist.barrier()


class Swapped:
    """The trainable weights at their starting values while inside (the reference policy),
    the current ones back after."""

    def __init__(self, starting: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        self.starting = starting
        self.current: list[torch.Tensor] = []

    def __enter__(self) -> None:
        self.current = [param.detach().clone() for param, _ in self.starting]
        with torch.no_grad():
            for param, value in self.starting:
                param.copy_(value)

    def __exit__(self, *_: Any) -> None:
        with torch.no_grad():
            for (param, _), value in zip(self.starting, self.current, strict=True):
                param.copy_(value)
        self.current = []


def plot_curves(metrics_file: Path, output: Path) -> bool:
    """The rollouts' mean reward per step and the held-out reward at each validation; False
    with fewer than two steps."""
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    steps = [row for row in rows if "reward" in row]
    if len(steps) < 2:
        return False
    # A Figure of its own draws to the file without pyplot.
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4))
    left, right = figure.subplots(1, 2)
    left.plot([r["step"] for r in steps], [r["reward"] for r in steps], label="rollouts")
    held = [row for row in rows if "validation_reward" in row]
    if held:
        left.plot(
            [r["step"] for r in held], [r["validation_reward"] for r in held],
            marker="o", label="held-out (greedy)",
        )  # fmt: skip
    left.set_xlabel("step")
    left.set_title("mean reward")
    left.legend()
    right.plot([r["step"] for r in steps], [r["completion_length"] for r in steps], color="C2")
    right.set_xlabel("step")
    right.set_title("completion length (tokens)")
    metrics.save_figure(figure, output)
    return True
