"""The critic as a server (PPO's servers layout, reference 5.16.2.3): the pretraining loop over
the critic's model, stepped by the actor's requests instead of a data stream.

The critic starts from `model.rlhf.critic.restore_from_path` (or the reward model), trains with
`model.rlhf.critic.optim` over `model.optim`, one optimizer step per actor step on the actor's
mini-batch, and keeps its checkpoints in `<results>/critic/checkpoints/`: it resumes from the
newest at start, and the actor checks that it is at the actor's own step.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from launcher_scripts.jobs.fine_tuning.ppo import CRITIC_STATS, critic_loss
from launcher_scripts.jobs.fine_tuning.preference_data import reduced_sums
from launcher_scripts.jobs.fine_tuning.rollouts import SAMPLE_KEYS, RolloutBatch
from launcher_scripts.jobs.training import data
from launcher_scripts.jobs.training.trainer import Streams, Trainer, TrainingTask

KEYS = (*SAMPLE_KEYS, "returns", "old_values")


class CriticTask(TrainingTask):
    def __init__(self, loaded: Any, settings: Any, seq_length: int) -> None:
        self.loaded, self.settings, self.seq_length = loaded, settings, seq_length
        self.batch = RolloutBatch()
        self.mode = "train"
        self.sums: dict[str, float] = {}

    def make_chunks(self, trainer: Trainer) -> list[Any]:
        from launcher_scripts.jobs.conversion import load

        par, precision = trainer.layout, trainer.cfg.trainer.precision
        chunks = load.build(self.loaded, par.tensor, par.pipeline, trainer.on_gpu, precision)
        for chunk in chunks:
            chunk.train()
        return chunks

    def build_data(self, trainer: Trainer) -> Streams:
        mbs = int(trainer.cfg.model.micro_batch_size)
        self.batch.length = 1 << 62  # global sample numbers only grow
        return Streams(data.SampleStream(self.batch, mbs, KEYS), None, 0)

    def forward_step(self, trainer: Trainer, batch: dict[str, Any], model: Any) -> tuple[Any, Any]:
        output = model(batch["tokens"], batch["position_ids"], None)
        return output, partial(critic_loss, self.settings, self.mode, batch)

    def after_step(self, trainer: Trainer, outputs: list[Any], seconds: float) -> None:
        del seconds
        self.sums = reduced_sums(outputs, "critic", CRITIC_STATS, trainer.device)

    def samples(self, body: dict[str, Any], training: bool) -> list[dict[str, torch.Tensor]]:
        """The request's rows as padded samples (with the training tensors when `training`)."""
        seq = self.seq_length
        made = []
        for index, row in enumerate(body["rows"]):
            if len(row) > seq:
                raise ValueError(f"row {index} has {len(row)} tokens; the sequence holds {seq}")
            tokens = torch.zeros(seq, dtype=torch.long)
            tokens[: len(row)] = torch.tensor(row, dtype=torch.long)
            sample = {
                "tokens": tokens,
                "position_ids": torch.arange(seq, dtype=torch.long),
                "labels": tokens,
                "loss_mask": torch.zeros(seq),
            }
            if training:
                for key in ("loss_mask", "returns", "old_values"):
                    values = torch.zeros(seq)
                    given = body[key if key != "loss_mask" else "masks"][index]
                    values[: len(given)] = torch.tensor(given, dtype=torch.float32)
                    sample[key] = values
            made.append(sample)
        return made


def server_recipe(recipe_cfg: Any, settings: Any, world: int) -> Any:
    """The actor's recipe made the critic's: its ranks one tensor-parallel group, its
    optimizer, its own results folder."""
    cfg = OmegaConf.create(OmegaConf.to_container(recipe_cfg, resolve=True))
    log_dir = Path(str(cfg.exp_manager.explicit_log_dir)) / "critic"
    cfg.model.tensor_model_parallel_size = world
    cfg.model.pipeline_model_parallel_size = 1
    cfg.model.sequence_parallel = False
    cfg.model.optim = OmegaConf.merge(cfg.model.optim, settings.critic_optim)
    cfg.trainer.devices, cfg.trainer.num_nodes = world, 1
    cfg.exp_manager.explicit_log_dir = str(log_dir)
    params = cfg.exp_manager.checkpoint_callback_params
    params.filename, params.monitor, params.save_top_k = "critic--{step}", "step", 1
    return cfg


def critic_handlers(recipe_cfg: Any, spec: Any, on_gpu: bool, scratch: Path) -> dict[str, Callable]:
    """The critic's requests, over a Trainer of the critic's file (its tokenizer extracted to
    `scratch`), resumed from its newest checkpoint."""
    import torch.distributed as dist

    from launcher_scripts.formats import portable
    from launcher_scripts.jobs.fine_tuning.finetune import training_cfg
    from launcher_scripts.jobs.training.pretrain import StopSignals

    settings = spec.objective
    loaded = portable.read(settings.critic, scratch)
    server = server_recipe(recipe_cfg, settings, dist.get_world_size())
    cfg = training_cfg(server, spec, loaded.config)
    task = CriticTask(loaded, settings, int(cfg.model.data.seq_length))
    trainer = Trainer(cfg, on_gpu, StopSignals(), task)
    trainer.prepare_data()
    trainer.resume()
    gbs, mbs = int(cfg.model.global_batch_size), int(cfg.model.micro_batch_size)

    def values(body: dict[str, Any]) -> dict[str, Any]:
        samples = task.samples(body, training=False)
        task.mode = "values"
        try:
            stream = data.SampleStream(samples, mbs, SAMPLE_KEYS)
            outputs = trainer.evaluate(stream, -(-len(samples) // gbs))
        finally:
            task.mode = "train"
        rows = data.evaluated_rows(outputs, "values", len(samples), mbs, gbs)
        assert rows is not None
        lengths = [len(row) for row in body["rows"]]
        return {"values": [row[:n].tolist() for row, n in zip(rows, lengths, strict=True)]}

    def train(body: dict[str, Any]) -> dict[str, Any]:
        samples = task.samples(body, training=True)
        if len(samples) != gbs:
            raise ValueError(
                f"a step trains on {gbs} samples (the global batch), not {len(samples)}"
            )
        task.batch.samples = samples
        task.batch.order = list(range(gbs))
        task.batch.start = trainer.state.consumed_samples
        trainer.train_step()
        return {"sums": task.sums, "step": trainer.state.step}

    def save(body: dict[str, Any]) -> dict[str, Any]:
        del body
        return {"path": str(trainer.save_checkpoint()), "step": trainer.state.step}

    def state(body: dict[str, Any]) -> dict[str, Any]:
        del body
        return {"step": trainer.state.step}

    return {"values": values, "train": train, "save": save, "state": state}
