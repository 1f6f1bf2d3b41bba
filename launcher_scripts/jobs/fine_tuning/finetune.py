"""Fine-tuning and PEFT on megatron-core: `python -m launcher_scripts.jobs.fine_tuning.finetune
--config F --stage S` (S: one of recipes.tuning.TUNING_STAGES).

The base model comes from a portable checkpoint (the conversion stage's .nemo) at whatever
TP/PP the recipe asks for; the architecture is the checkpoint's, the recipe gives the layout,
batch sizes, dropout, optimizer and data. Training reuses the pretraining loop (checkpoints,
resume, signals, metrics); what differs is the model set-up, the SFT data, the validation
metrics and the outputs:
  - PEFT methods: only the added tensors, in a small PEFT file (`spec.output_file`);
  - full SFT: a portable checkpoint of the whole tuned model at the same path;
  - with a test set: greedy generations, one JSON line per sample, beside it.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher_scripts.errors import ConfigError
from launcher_scripts.families import DEFAULT as DEFAULT_FAMILY  # also: shape tables
from launcher_scripts.jobs.fine_tuning import sft_data
from launcher_scripts.jobs.refusal import refuse
from launcher_scripts.recipes.tuning import (
    BLOCK_SECTIONS,
    LAYOUT_KEYS,
    TuningSpec,
    check_positions,
    read_spec,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the stage's resolved YAML")
    parser.add_argument("--stage", required=True, help="the stage the recipe belongs to")
    return parser.parse_args(argv)


def training_cfg(
    cfg: Any, spec: TuningSpec, base_model: DictConfig, task: Any = None
) -> DictConfig:
    """The pretraining loop's config: the base model's architecture and tokenizer with the
    recipe's layout, batches, optimizer and sequence length, and what the task (a TuningTask
    class) changes: its model overrides, its batch sizes counted in sequences."""
    model = OmegaConf.to_container(base_model, resolve=True)
    assert isinstance(model, dict)
    for unused in ("data", "optim", "nsys_profile", "precision", "rampup_batch_size"):
        model.pop(unused, None)
    recipe_model = cfg.model
    for key in LAYOUT_KEYS:
        if recipe_model.get(key) is not None:
            value = OmegaConf.to_container(recipe_model, resolve=True)[key]
            model[key] = value
            # An encoder-decoder's blocks hold their own dropout and recomputation, which
            # override the model's: the recipe's value replaces theirs too.
            for block in BLOCK_SECTIONS:
                if isinstance(model.get(block), dict) and key in model[block]:
                    model[block][key] = value
    model |= {
        "virtual_pipeline_model_parallel_size": None,
        "context_parallel_size": 1,
        "sequence_parallel": bool(recipe_model.get("sequence_parallel", False)),
        # The embedding rows are already padded: take them as they are.
        "make_vocab_size_divisible_by": 1,
        # PEFT hooks sit on the local layer spec's linears (TE fuses the norm into qkv).
        # Packed samples need the attention mask, which TE's causal kernels do not read.
        "transformer_engine": bool(model.get("transformer_engine"))
        and spec.peft is None
        and not spec.train.section.get("packed_sequence"),
        "optim": OmegaConf.to_container(recipe_model.optim, resolve=True),
        "data": {"seq_length": spec.train.max_seq_length}
        | ({"seq_length_dec": target} if (target := spec.train.max_target_length) else {}),
    }
    if task is not None:
        model |= task.model_overrides
        for key in ("global_batch_size", "micro_batch_size"):
            model[key] = int(model[key]) * task.sequences_per_example(spec)
    trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
    assert isinstance(trainer, dict)
    trainer["max_steps"] = max_steps(cfg, spec)
    return OmegaConf.create(
        {
            "model_family": model.pop("model_family", DEFAULT_FAMILY),
            "run": OmegaConf.to_container(cfg.run, resolve=True),
            "trainer": trainer,
            "exp_manager": OmegaConf.to_container(cfg.exp_manager, resolve=True),
            "model": model,
        }
    )


def max_steps(cfg: Any, spec: TuningSpec) -> int:
    """trainer.max_steps, or with max_steps -1 (NeMo's "bounded by epochs"), the steps that
    make trainer.max_epochs passes over the training records."""
    steps = cfg.trainer.get("max_steps")
    if steps is not None and int(steps) > 0:
        return int(steps)
    epochs = cfg.trainer.get("max_epochs")
    if not epochs or int(epochs) < 1:
        raise ConfigError(
            f"{spec.stage}.trainer.max_steps",
            f"is {steps} and max_epochs is {epochs}: nothing bounds the run",
            "Set trainer.max_steps, or max_steps=-1 with trainer.max_epochs",
        )
    records = 0
    for path in spec.train.files:
        if spec.train.preference:
            from launcher_scripts.jobs.fine_tuning.preference_data import count_pairs

            records += count_pairs(path)
            continue
        with path.open(encoding="utf-8") as lines:
            records += sum(1 for line in lines if line.strip())
    batch = int(cfg.model.global_batch_size)
    steps = max(1, math.ceil(records * int(epochs) / batch))
    print(f"max_steps: {steps} ({epochs} epochs of {records} records at global batch {batch})")
    return steps


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    recipe_cfg = OmegaConf.load(args.config)
    from launcher_scripts.jobs.training import runtime, wandb_logger

    on_gpu, info = runtime.start_job(recipe_cfg)
    from launcher_scripts.formats import portable
    from launcher_scripts.formats.portable_check import inspect_peft, inspect_portable
    from launcher_scripts.formats.tokenizer import TokenizerError
    from launcher_scripts.jobs.training.pretrain import StopSignals
    from launcher_scripts.jobs.training.runtime import JobError
    from launcher_scripts.recipes.training import rendezvous_timeout

    try:
        wandb_logger.check_ready(recipe_cfg.exp_manager, args.stage)
        spec = read_spec(recipe_cfg, args.stage)
        log_dir = Path(str(recipe_cfg.exp_manager.explicit_log_dir))
        log_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=log_dir, prefix=".base-") as scratch:
            try:
                inspect_portable(spec.base_model)  # whole and self-consistent, before loading
                if spec.peft_restore is not None:
                    inspect_peft(spec.peft_restore)
                base = portable.read(spec.base_model, Path(scratch))
            except (OSError, ValueError) as error:
                raise JobError(f"{spec.base_key}: {error}") from None
            from launcher_scripts.jobs.fine_tuning.tasks import TASKS
            from launcher_scripts.jobs.training.trainer import Trainer

            task = TASKS[spec.task]
            cfg = training_cfg(recipe_cfg, spec, base.config, task)
            check_positions(spec, cfg.model)
            runtime.init_distributed(info, on_gpu, rendezvous_timeout(cfg))
            return Trainer(cfg, on_gpu, StopSignals(), task(cfg, spec, base)).fit()
    except (JobError, TokenizerError, ConfigError, sft_data.SftDataError) as error:
        return refuse(error)
    finally:
        runtime.shutdown()


if __name__ == "__main__":
    sys.exit(main())
