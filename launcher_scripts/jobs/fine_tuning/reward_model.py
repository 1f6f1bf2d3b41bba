"""The reward model's training task (the rlhf_rm stage, reference 5.16.1).

A GPT-family base (ours, or an imported Llama, Mistral, Qwen2...) whose output layer is
replaced by a scalar head: the reward of a text is the head's value at its last token. Pairs
of texts (jobs/fine_tuning/preference_data.py) train it with the pairwise ranking loss,
-log sigmoid(r_chosen - r_rejected), every weight or LoRA (merged into the weights at the
end). Validation measures the loss, the share of pairs ranked right and the rewards' mean and
std; the output is a portable file with the head, the mean and std in its model_config.yaml
(`reward_model`), which PPO's reward server reads to normalise.
"""

from __future__ import annotations

import json
import math
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from launcher_scripts.files import replaced_directory, write_atomic
from launcher_scripts.formats import portable
from launcher_scripts.formats.portable import REWARD_HEAD, REWARD_MODEL
from launcher_scripts.jobs.conversion.convert import write_hf_files
from launcher_scripts.jobs.fine_tuning import peft, peft_file
from launcher_scripts.jobs.fine_tuning.merge_lora import merged
from launcher_scripts.jobs.fine_tuning.preference_data import (
    SAMPLE_KEYS,
    SampleOf,
    mean_loss,
    pair_values,
    reduced_sums,
    scored_sample,
)
from launcher_scripts.jobs.fine_tuning.preference_task import PreferenceTask
from launcher_scripts.jobs.fine_tuning.tuner import bare_chunks, file_size
from launcher_scripts.jobs.models.reward_head import with_reward_head
from launcher_scripts.jobs.training import data
from launcher_scripts.jobs.training.trainer import Streams, Trainer
from launcher_scripts.recipes.tuning import DataSplit

# The sums one micro-batch reports, in this order (all ratios of them survive the
# tensor-parallel ranks' repeats).
STATS = ("pairs", "ranked_right", "reward_sum", "reward_square_sum", "chosen_sum", "rejected_sum")


def pairwise_loss(lengths: torch.Tensor, output: torch.Tensor) -> tuple[Any, Any, Any]:
    """The summed ranking loss of a micro-batch's pairs (rows 2i chosen, 2i + 1 rejected; a
    pair of empty rows is padding) and their count; the STATS sums beside it."""
    values = output[..., 0].float()
    rewards = values[torch.arange(values.shape[0]), (lengths - 1).clamp(min=0)]
    chosen, rejected = rewards[0::2], rewards[1::2]
    real = (lengths[0::2] > 0).to(rewards)
    margins = chosen - rejected
    loss = torch.sum(-F.logsigmoid(margins) * real)
    pairs = real.sum()
    stats = torch.stack(
        [
            pairs,
            ((margins > 0).to(rewards) * real).sum(),
            ((chosen + rejected) * real).sum(),
            ((chosen**2 + rejected**2) * real).sum(),
            (chosen * real).sum(),
            (rejected * real).sum(),
        ]
    ).detach()
    report = {
        "lm loss": torch.stack([loss.detach(), pairs]),
        "rewards": stats,
        "pair_rewards": torch.stack([chosen, rejected], dim=1).detach(),  # padding included
    }
    return loss, pairs.to(torch.int), report


def summary(outputs: list[dict[str, torch.Tensor]], device: str) -> dict[str, float]:
    """Accuracy and rewards over every rank's micro-batches (the same on every rank)."""
    values = reduced_sums(outputs, "rewards", STATS, device)
    pairs = max(values["pairs"], 1.0)
    mean = values["reward_sum"] / (2 * pairs)
    return {
        "accuracy": values["ranked_right"] / pairs,
        "reward_mean": mean,
        "reward_std": math.sqrt(max(values["reward_square_sum"] / (2 * pairs) - mean**2, 0.0)),
        "rewards_chosen": values["chosen_sum"] / pairs,
        "rewards_rejected": values["rejected_sum"] / pairs,
    }


class RewardModelTask(PreferenceTask):
    sample_keys = SAMPLE_KEYS
    model_overrides = {"share_embeddings_and_output_weights": False}  # a head, not the table
    standardization: dict[str, float] | None = None
    validated_step: int | None = None  # the step of the last validation

    @classmethod
    def sequences_per_example(cls, spec: Any) -> int:
        del spec
        return 2  # the recipe's batch sizes count pairs

    def reshape(self, trainer: Trainer, chunks: list[Any]) -> None:
        with_reward_head(chunks, trainer.config)

    def own_key(self, key: str) -> bool:
        return key == REWARD_HEAD

    def own_parameter(self, name: str) -> bool:
        return name.startswith("output_layer.")

    # ----- data -------------------------------------------------------------------------

    def sample_maker(self, split: str) -> SampleOf:
        del split
        return scored_sample(self.seq_length, self.tokenizer.eod_id)

    def build_data(self, trainer: Trainer) -> Streams:
        pairs = self.read_pairs(trainer, self.spec.train, "train")
        samples = self.train_samples(trainer, pairs)
        mbs = int(trainer.cfg.model.micro_batch_size)
        train = data.SampleStream(samples, mbs, SAMPLE_KEYS)
        if self.spec.validation is None:
            return Streams(train, None, 0)
        valid_pairs = self.read_pairs(trainer, self.spec.validation, "validation")
        valid, batches = self.eval_stream(trainer, valid_pairs, "validation")
        return Streams(train, valid, self.validation_batches(trainer, batches))

    def forward_step(self, trainer: Trainer, batch: dict[str, Any], model: Any) -> tuple[Any, Any]:
        output = model(batch["tokens"], batch["position_ids"], None)  # causal
        return output, partial(pairwise_loss, batch["lengths"])

    # ----- validation -------------------------------------------------------------------

    def after_validation(self, trainer: Trainer, loss: float, outputs: list[Any]) -> None:
        if math.isnan(loss):
            return
        scores = summary(outputs, trainer.device)
        self.standardization = {"mean": scores["reward_mean"], "std": scores["reward_std"]}
        self.validated_step = trainer.state.step
        self.record_validation(
            trainer,
            loss,
            scores,
            f"accuracy {scores['accuracy']:.3f}, reward mean {scores['reward_mean']:.3f} "
            f"std {scores['reward_std']:.3f}",
        )

    # ----- outputs ----------------------------------------------------------------------

    def write_outputs(self, trainer: Trainer) -> None:
        spec = self.spec
        if trainer.valid_stream is not None and self.validated_step != trainer.state.step:
            trainer.validate()  # the file's mean and std are the final model's
        if spec.test is not None:
            self._test(trainer, spec.test)
        tensors = peft_file.gather_full(bare_chunks(trainer), lambda key: True)
        if trainer.rank == 0 and tensors is not None:
            if spec.peft is not None:  # LoRA folded into the weights it adapts
                added = {k: v for k, v in tensors.items() if peft.is_peft_key(k)}
                kept = {k: v for k, v in tensors.items() if not peft.is_peft_key(k)}
                tensors = merged(kept, added, spec.peft)
            config = self.base.config.copy()
            config.tensor_model_parallel_size = trainer.layout.tensor
            config.pipeline_model_parallel_size = trainer.layout.pipeline
            config.share_embeddings_and_output_weights = False
            config[REWARD_MODEL] = self.standardization or {"mean": 0.0, "std": 1.0}
            portable.write(spec.output_file, config, tensors)
            trainer.say(f"reward model ({file_size(spec.output_file)}): {spec.output_file}")
            hf_dir_name = trainer.cfg.run.get("hf_dir_name")
            if hf_dir_name:
                hf_dir = trainer.log_dir / str(hf_dir_name)
                with replaced_directory(hf_dir) as partial:
                    write_hf_files(partial, config, tensors)
                trainer.say(f"Hugging Face sequence classifier: {hf_dir}")
        dist.barrier()

    def _test(self, trainer: Trainer, split: DataSplit) -> None:
        """Accuracy and rewards over the test pairs (test_metrics.json), and each pair's
        tokens and rewards (test_rewards.jsonl)."""
        pairs = self.read_pairs(trainer, split, "test")
        stream, batches = self.eval_stream(trainer, pairs, "test")
        outputs = trainer.evaluate(stream, batches)
        scores = summary(outputs, trainer.device)
        scores["loss"] = mean_loss(outputs, trainer.device)
        rewards = pair_values(trainer, outputs, len(pairs), "pair_rewards")
        if self.standardization is None:
            self.standardization = {"mean": scores["reward_mean"], "std": scores["reward_std"]}
        if rewards is None:
            return
        lines = [
            json.dumps(
                {
                    "source": pair.where,
                    "chosen_ids": pair.side(False),
                    "rejected_ids": pair.side(True),
                    "chosen": chosen,
                    "rejected": rejected,
                }
            )
            for pair, (chosen, rejected) in zip(pairs, rewards, strict=True)
        ]
        write_atomic(trainer.log_dir / "test_rewards.jsonl", "".join(f"{line}\n" for line in lines))
        path = trainer.log_dir / "test_metrics.json"
        write_atomic(path, json.dumps(scores, indent=2) + "\n")
        trainer.say(f"test set: accuracy {scores['accuracy']:.3f} over {len(pairs)} pairs; {path}")
