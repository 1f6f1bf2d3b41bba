"""The tuning stages: fine_tuning (full SFT), peft, prompt_learning, adapter_learning,
ia3_learning, rlhf_rm (reward models) and dpo. One distributed job each, running the tuning
program on the recipe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from launcher_scripts.config.schema import Declared
from launcher_scripts.errors import RecipeError
from launcher_scripts.families import family_of, running
from launcher_scripts.families.file_family import (
    require_family,
    require_pair,
    tuning_reader,
    twin_problem,
)
from launcher_scripts.formats.portable_check import require_peft, require_portable
from launcher_scripts.formats.progress import EXIT_PREEMPTED
from launcher_scripts.jobspec import Command, Companion, JobSpec, Resources
from launcher_scripts.recipes import training as recipe
from launcher_scripts.recipes.early_stopping import read_early_stopping
from launcher_scripts.recipes.layout import check_world, read_layout
from launcher_scripts.recipes.optimizer import check_optimizer
from launcher_scripts.recipes.tuning import (
    OPTIONAL_KEYS,
    TUNING_STAGES,
    all_inputs,
    check_positions,
    check_record_files,
    most_layers,
    objective_models,
    read_spec,
    reward_models,
    served_roles,
)
from launcher_scripts.stages.base import (
    StageContext,
    StageDefaults,
    make_job,
    register,
    require_job_program,
)

FINETUNE = "launcher_scripts.jobs.fine_tuning.finetune"
SERVER = "launcher_scripts.jobs.fine_tuning.ppo_server"  # a served role of a tuning task


class TuningStage(StageDefaults):
    name = ""

    def validate(self, ctx: StageContext) -> None:
        cfg, stage = ctx.cfg, ctx.stage
        family = family_of(cfg, stage)
        check_optimizer(cfg.model, stage)
        read_early_stopping(cfg.exp_manager, stage)
        runnable = family.runs(self.name)
        require_job_program(ctx, "model_family", family.name, runnable)
        if not runnable:
            return  # such recipes compose and render; their job program is not written
        spec = read_spec(cfg, stage)
        for key, path in all_inputs(spec):
            if not path.exists() and not ctx.will_exist(path):
                raise RecipeError(
                    f"{key}: {ctx.not_written(path)}: give an existing file (see "
                    "docs/fine_tuning.md)"
                )
        check_record_files(spec)
        layout = read_layout(cfg, stage)
        check_world(layout, stage)
        recipe.check_batch(cfg.model, layout, stage)
        lengths = [(spec.train.length_key, spec.train.max_seq_length)]
        if spec.train.max_target_length is not None:
            target_key = f"{spec.train.format_key}.max_tgt_seq_length"
            lengths.append((target_key, spec.train.max_target_length))
        for length_key, seq in lengths:
            if layout.sequence_parallel and seq % layout.tensor:
                raise RecipeError(
                    f"{length_key}: {seq} does not split over tensor_model_parallel_size "
                    f"{layout.tensor} (sequence_parallel): use a multiple"
                )
        base = self._check_base(spec, family, cfg.model, layout, stage)
        for key, path in objective_models(spec):
            if base is None or not path.is_file():
                continue
            other = require_portable(path, key, "Give a .nemo file the conversion stage writes")
            problem = twin_problem(base, spec.base_model, other, path)
            if problem is not None:
                raise RecipeError(f"{key}: {problem}")
        for key, path in reward_models(spec):
            if base is not None and path.is_file():
                _check_reward_model(key, path, spec.base_model)
        if spec.peft_restore is not None and spec.peft_restore.is_file():
            restore = spec.peft_restore_key
            tuned = require_peft(spec.peft_restore, restore)
            if base is not None:
                require_pair(tuned, restore, spec.peft_restore, base, spec.base_model)

    @staticmethod
    def _check_base(spec, family, model, layout, stage: str) -> Any:  # type: ignore[no-untyped-def]
        """The base model's section, checked to take the recipe; None before it exists."""
        if not spec.base_model.is_file():
            return None
        base = require_portable(
            spec.base_model, spec.base_key, "Give the .nemo file the conversion stage writes"
        )
        family_of(base, spec.base_key)  # a family this version knows
        require_family(base, family, spec.base_key, spec.base_model, tuning_reader(stage))
        assert family.check_base is not None, family.name
        family.check_base(base, model, layout, stage, f"{spec.base_key} ({spec.base_model.name})")
        if spec.peft is not None:
            spec.peft.check_layers(f"{stage}.model", most_layers(base))
            check_model = spec.peft.method.check_model
            if check_model is not None:
                where = spec.peft_key.removeprefix(f"{stage}.model").lstrip(".")
                section = OmegaConf.select(model, where) if where else model
                check_model(spec.peft, section or {}, base, family.encoder_decoder, spec.peft_key)
        check_positions(spec, base)
        return base

    def jobs(self, ctx: StageContext) -> list[JobSpec]:
        cfg = ctx.cfg
        devices, nodes = int(cfg.trainer.devices), int(cfg.trainer.num_nodes)
        on_gpu = str(cfg.trainer.get("accelerator", "gpu")) != "cpu"
        log_dir = Path(str(cfg.exp_manager.explicit_log_dir))
        reads: tuple[str, ...] = ()
        writes: tuple[str, ...] = (str(log_dir),)
        served: list[tuple[str, int]] = []
        if family_of(cfg, ctx.stage).runs(self.name):
            spec = read_spec(cfg, ctx.stage)
            reads = tuple(str(path) for _, path in all_inputs(spec))
            writes = (str(log_dir / "checkpoints"), str(spec.output_file))
            served = served_roles(spec)
        argv = ("--config", str(ctx.config_path), "--stage", ctx.stage)
        time_limit = str(cfg.run.time_limit)

        def resources(processes: int, node_count: int) -> Resources:
            return Resources(
                nodes=node_count,
                ntasks_per_node=processes,
                gpus_per_node=processes if on_gpu else 0,
                time_limit=time_limit,
                exclusive=on_gpu,
            )

        companions = tuple(
            Companion(
                role,
                Command(SERVER, (*argv, "--role", role), nproc_per_node=processes),
                resources(processes, 1),
                f"{ctx.stage}.model.rlhf.layout",
            )
            for role, processes in served
        )
        return [
            make_job(
                ctx,
                str(cfg.run.name),
                (Command(FINETUNE, argv, nproc_per_node=devices),),
                resources(devices, nodes),
                reads=reads,
                writes=writes,
                checkpoint_exit_code=EXIT_PREEMPTED,
                progress_dir=str(log_dir / "checkpoints"),
                companions=companions,
            )
        ]


def _check_reward_model(key: str, path: Path, base_path: Path) -> None:
    """A reward model the rlhf_rm stage wrote, holding the policy's tokenizer (it scores the
    policy's token ids)."""
    from launcher_scripts.formats.portable import REWARD_MODEL, tokenizer_digest

    scorer = require_portable(path, key, "Give the .nemo file the rlhf_rm stage writes")
    if tokenizer_digest(path) != tokenizer_digest(base_path):
        raise RecipeError(
            f"{key}: {path} and {base_path} hold different tokenizers: the reward model scores "
            "the policy's token ids, so train it from a model with the policy's tokenizer"
        )
    if REWARD_MODEL not in scorer:
        raise RecipeError(
            f"{key}: {path} is not a reward model (no {REWARD_MODEL} section): give the .nemo "
            "file the rlhf_rm stage writes"
        )


def _declared(stage_name: str) -> tuple[Declared, ...]:
    """The keys the tuning program and its training loop read beyond the shipped recipes'."""
    optional = (*recipe.LOOP_OPTIONAL_KEYS, *OPTIONAL_KEYS["common"], *OPTIONAL_KEYS[stage_name])
    return (
        Declared(optional=optional, when=(("model_family", running(stage_name)),)),
        Declared(free_form=recipe.LOOP_FREE_FORM),
    )


def _stage(stage_name: str) -> type[TuningStage]:
    return type(
        f"{stage_name.title().replace('_', '')}Stage",
        (TuningStage,),
        {"name": stage_name, "declared_keys": _declared(stage_name)},
    )


for _name in TUNING_STAGES:
    register(_stage(_name))
