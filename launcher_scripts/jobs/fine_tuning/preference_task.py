"""What the tasks that learn from preference pairs share (the reward model's and DPO's): the
pairs of a split read and reported, the training stream of shuffled pairs, the evaluation
stream of every pair once, and the validation metrics recorded and said."""

from __future__ import annotations

from typing import Any

from launcher_scripts.jobs.fine_tuning.preference_data import (
    EvalPairs,
    Pair,
    PairSamples,
    SampleOf,
    chat_template,
    load_pairs,
)
from launcher_scripts.jobs.fine_tuning.tuner import TuningTask
from launcher_scripts.jobs.training import data
from launcher_scripts.jobs.training.trainer import Trainer
from launcher_scripts.recipes.tuning import DataSplit

LABELS = {"train": "training data", "validation": "validation data", "test": "test data"}


class PreferenceTask(TuningTask):
    sample_keys: tuple[str, ...] = ()  # what a sample holds (SampleStream's keys)
    # Each answer ends with the end-of-document token, and an indexed pair's shared start is
    # its prompt (a policy's pairs, not a reward model's).
    generative = False

    def sample_maker(self, split: str) -> SampleOf:
        """The samples of a split's pairs (a pair is two)."""
        raise NotImplementedError

    def read_pairs(self, trainer: Trainer, split: DataSplit, name: str) -> list[Pair]:
        """A split's pairs (`name`: train, validation or test), with a line saying what was
        read."""
        template = chat_template(self.base.config.get("tokenizer"))
        pairs, report = load_pairs(
            split.files, self.tokenizer, template, self.seq_length, LABELS[name], self.generative
        )
        trainer.say(report)
        return pairs

    def train_samples(self, trainer: Trainer, pairs: list[Pair]) -> PairSamples:
        """The run's pairs, shuffled anew each epoch: two samples each."""
        count = int(trainer.cfg.trainer.max_steps) * int(trainer.cfg.model.global_batch_size) // 2
        return PairSamples(pairs, count, self.sample_maker("train"), trainer.seed, shuffle=True)

    def eval_stream(self, trainer: Trainer, pairs: list[Pair], split: str) -> tuple[Any, int]:
        """Every pair once, in order, padded to whole global batches; and how many."""
        model = trainer.cfg.model
        samples = EvalPairs(pairs, int(model.global_batch_size), self.sample_maker(split))
        stream = data.SampleStream(samples, int(model.micro_batch_size), self.sample_keys)
        return stream, samples.batches

    def record_validation(
        self, trainer: Trainer, loss: float, scores: dict[str, float], line: str
    ) -> None:
        """The validation loss and scores into the run's metrics and metrics.jsonl; `line`
        after "validation at step N: "."""
        found = {"validation_loss": loss, **{f"validation_{k}": v for k, v in scores.items()}}
        trainer.state.metrics.update(found)
        trainer.record({"step": trainer.state.step, **found})
        trainer.say(f"validation at step {trainer.state.step}: {line}")
