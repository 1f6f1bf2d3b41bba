"""The conversion stage: a training checkpoint to a portable file and a Hugging Face directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launcher_scripts.config.checks import require_int, require_layout
from launcher_scripts.errors import ConfigError, RecipeError
from launcher_scripts.jobs.conversion.architectures import hf_architecture
from launcher_scripts.jobs.conversion.convert import (
    CONVERTED_FAMILIES,
    ConversionError,
    pick_checkpoint,
    read_hparams,
)
from launcher_scripts.jobs.training.families import family_of
from launcher_scripts.jobspec import Command, JobSpec, Resources
from launcher_scripts.stages.base import StageContext, make_job, register, require_job_program

CONVERT = "launcher_scripts.jobs.conversion.convert"


@register
class Conversion:
    name = "conversion"

    def validate(self, ctx: StageContext) -> None:
        cfg, stage = ctx.cfg, ctx.stage
        for name in ("checkpoint_folder", "hparams_file"):
            ctx.require_input(
                name,
                f"Train first (stages=[training,conversion]), or set {stage}.run."
                "model_train_name to the training run to convert",
            )
        folder = Path(str(cfg.model.checkpoint_folder))
        if folder.exists() and not ctx.written_upstream(folder):
            try:  # before the job replaces the last good outputs
                pick_checkpoint(folder, str(cfg.model.checkpoint_name))
            except ConversionError as error:
                raise RecipeError(str(error)) from None
        if not str(cfg.run.nemo_file_name).endswith(".nemo"):
            raise ConfigError(
                f"{stage}.run.nemo_file_name", "does not end in .nemo", "Name it e.g. model.nemo"
            )
        tp = require_int(
            f"{stage}.model.tensor_model_parallel_size", cfg.model.tensor_model_parallel_size
        )
        pp = require_int(
            f"{stage}.model.pipeline_model_parallel_size", cfg.model.pipeline_model_parallel_size
        )
        family = family_of(cfg, stage).name
        converted = family in CONVERTED_FAMILIES
        require_job_program(ctx, "model_family", f"{family} checkpoints", converted)
        trained = self._trained_model(ctx) if converted else None
        if trained is None:
            return
        model, model_key = trained
        require_layout(model, tp, pp, f"{stage}.model")
        if cfg.run.get("hf_dir_name"):
            hf_architecture(model, key_prefix=model_key)

    @staticmethod
    def _trained_model(ctx: StageContext) -> tuple[Any, str] | None:
        """The trained model's section and the key to name in errors: from its hparams file,
        or from the training recipe of this same run when that writes the file."""
        hparams = Path(str(ctx.cfg.model.hparams_file))
        if hparams.is_file():
            return read_hparams(hparams), str(hparams)
        if ctx.will_exist(hparams) and "training" in ctx.root:
            return ctx.root.training.model, "training.model"
        return None

    def jobs(self, ctx: StageContext) -> list[JobSpec]:
        cfg = ctx.cfg
        output = Path(str(cfg.run.output_path))
        writes = [str(output / str(cfg.run.nemo_file_name))]
        if cfg.run.get("hf_dir_name"):
            writes.append(str(output / str(cfg.run.hf_dir_name)))
        return [
            make_job(
                ctx,
                str(cfg.run.name),
                (Command(CONVERT, ("--config", str(ctx.config_path))),),
                # One process reads a checkpoint of any layout: no GPUs, no exclusive node.
                Resources(time_limit=str(cfg.run.time_limit)),
                reads=(str(cfg.model.checkpoint_folder), str(cfg.model.hparams_file)),
                writes=tuple(writes),
            )
        ]
