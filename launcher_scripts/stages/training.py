"""The training stage: one distributed job running the pretraining program on the recipe."""

from __future__ import annotations

from pathlib import Path

from launcher_scripts.config.compose import recipe_options
from launcher_scripts.config.schema import Declared
from launcher_scripts.costmodel import plan as training_plan
from launcher_scripts.errors import ConfigError
from launcher_scripts.families import ModelFamily, family_of, running
from launcher_scripts.families.file_family import RESTORE_READER, require_family
from launcher_scripts.formats.portable_check import PortableFileError, inspect_portable
from launcher_scripts.formats.progress import EXIT_PREEMPTED
from launcher_scripts.jobspec import Command, JobSpec, Resources
from launcher_scripts.recipes import data_tokenizer, restore, vocabulary
from launcher_scripts.recipes import training as recipe
from launcher_scripts.recipes.profiling import PROFILED, NsysProfile, read_nsys_profile
from launcher_scripts.stages import data_preparation
from launcher_scripts.stages.base import (
    StageContext,
    StageDefaults,
    make_job,
    register,
    require_job_program,
)

PRETRAIN = "launcher_scripts.jobs.training.pretrain"
TRAINED = (("model_family", running("training")),)  # the families the training loop runs
RESTORED = (("model_family", running("training:restore")),)


def _check_restored_family(ctx: StageContext, family: ModelFamily) -> None:
    """Continued pretraining's file holds a model of the recipe's family (before the
    family's checks compare the file's architecture with the recipe's)."""
    path = restore.restore_path(ctx.cfg.model)
    if path is None or not Path(path).is_file():
        return  # the recipe's checks name a missing file, or the job checks it when written
    try:
        model = inspect_portable(path).config
    except PortableFileError:
        return  # the recipe's checks name the damage and the key
    where = f"{ctx.stage}.{restore.RESTORE_KEY}"
    require_family(model, family, where, path, RESTORE_READER)


@register
class Training(StageDefaults):
    name = "training"
    declared_keys = (
        Declared(optional=recipe.LOOP_OPTIONAL_KEYS, when=TRAINED),
        Declared(optional=recipe.RESTORE_OPTIONAL_KEYS, when=RESTORED),
        Declared(free_form=recipe.LOOP_FREE_FORM),
    )

    def validate(self, ctx: StageContext) -> None:
        family = family_of(ctx.cfg, ctx.stage)
        _check_restored_family(ctx, family)
        try:
            family.validate(ctx.cfg, ctx.stage, ctx.will_exist)
        except ConfigError as error:
            raise _naming_the_runs_data(error, ctx, family) from None
        require_job_program(ctx, "model_family", family.name, family.runs("training"))
        recipe.check_context_parallel(ctx.cfg, ctx.stage, ctx.jobs_find_gpus)
        prefixes = recipe.data_blend(ctx.cfg, ctx.stage).prefixes
        recipe.blending_alpha(ctx.cfg, ctx.stage)
        planned = {
            prefix: files
            for prefix, files in data_preparation.tokenized_with(ctx.root).items()
            if ctx.written_upstream(prefix)
        }
        data_tokenizer.check_data_tokenizer(ctx.cfg, ctx.stage, prefixes, planned)
        vocabulary.check_training_data(ctx.cfg, ctx.stage, prefixes)
        plan = family.plan(ctx.root, ctx.stage)
        training_plan.check_fits(plan, ctx.stage)
        profile = self._nsys_profile(ctx)
        max_steps = int(ctx.cfg.trainer.max_steps)
        if profile is not None and profile.start_step > max_steps:
            raise ConfigError(
                f"{ctx.stage}.model.nsys_profile.start_step",
                f"{profile.start_step} is after the last step, trainer.max_steps={max_steps}",
                f"Profile steps up to {max_steps}",
            )

    @staticmethod
    def _nsys_profile(ctx: StageContext) -> NsysProfile | None:
        cfg = ctx.cfg
        world = int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)
        on_gpu = str(cfg.trainer.get("accelerator", "gpu")) != "cpu"
        return read_nsys_profile(cfg.model, f"{ctx.stage}.model", world, on_gpu)

    def plan(self, ctx: StageContext) -> list[str]:
        """What the dry run prints about this stage's cost."""
        family = family_of(ctx.cfg, ctx.stage)
        return training_plan.describe(family.plan(ctx.root, ctx.stage))

    def jobs(self, ctx: StageContext) -> list[JobSpec]:
        cfg = ctx.cfg
        devices, nodes = int(cfg.trainer.devices), int(cfg.trainer.num_nodes)
        on_gpu = str(cfg.trainer.get("accelerator", "gpu")) != "cpu"
        log_dir = Path(str(cfg.exp_manager.explicit_log_dir))
        blend = recipe.data_blend(cfg, ctx.stage)
        program = (PRETRAIN, ("--config", str(ctx.config_path)))
        profile = self._nsys_profile(ctx)
        if profile is not None:
            program = (PROFILED, profile.wrapped(*program, log_dir))
        return [
            make_job(
                ctx,
                str(cfg.run.name),
                (Command(*program, nproc_per_node=devices),),
                Resources(
                    nodes=nodes,
                    ntasks_per_node=devices,
                    gpus_per_node=devices if on_gpu else 0,
                    time_limit=str(cfg.run.time_limit),
                    exclusive=on_gpu,
                ),
                reads=(*blend.prefixes, *filter(None, [recipe.tokenizer_file(cfg)])),
                writes=(str(log_dir / "checkpoints"), str(log_dir / "hparams.yaml")),
                checkpoint_exit_code=EXIT_PREEMPTED,
                progress_dir=str(log_dir / "checkpoints"),
            )
        ]


# Megatron's names for preprocessed data: <prefix>.bin/.idx, the prefix ending in the level.
_DATA_LEVELS = ("_document", "_sentence")


def _naming_the_runs_data(
    error: ConfigError, ctx: StageContext, family: ModelFamily
) -> ConfigError:
    """A data prefix that this run's data preparation does not write most often means that the
    data and training recipes do not match (the default data preparation with a recipe trained
    on the Pile): say so, naming what the run writes and the family's own data recipes."""
    written = sorted(w for w in ctx.upstream_writes if w.endswith(_DATA_LEVELS))
    if error.key != f"{ctx.stage}.model.data.data_prefix" or not written:
        return error
    shown = ", ".join(written[:2]) + (f" and {len(written) - 2} more" if len(written) > 2 else "")
    own = [
        f"data_preparation={name}"
        for name in recipe_options("data_preparation")
        if name.split("/")[0] in family.model_types
    ]
    return ConfigError(
        error.key,
        error.problem + f" (this run's data preparation writes {shown})",
        f"Prepare this recipe's data ({' or '.join(own) or 'its data_preparation recipe'}), or "
        f"point {error.key} and {ctx.stage}.model.tokenizer at what this run writes",
    )
