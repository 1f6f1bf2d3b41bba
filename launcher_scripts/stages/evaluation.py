"""The evaluation stage: lm-evaluation-harness tasks on the conversion stage's portable file,
as one job of TP x PP processes on one node."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launcher_scripts.config import nemo_keys
from launcher_scripts.config.checks import require_choice, require_int, require_layout
from launcher_scripts.config.schema import Declared
from launcher_scripts.errors import ConfigError, RecipeError
from launcher_scripts.families import ModelFamily, family_mismatch, family_of, running
from launcher_scripts.families.file_family import (
    evaluation_reader,
    require_family,
    require_pair,
    require_peft_family,
)
from launcher_scripts.formats.portable_check import require_peft
from launcher_scripts.jobspec import Command, JobSpec, Resources
from launcher_scripts.recipes import evaluation as recipe
from launcher_scripts.recipes import tuned_evaluation as evaluate_tuned
from launcher_scripts.recipes.conversion import hparams_path
from launcher_scripts.stages.base import (
    StageContext,
    StageDefaults,
    make_job,
    register,
    require_job_program,
)
from launcher_scripts.stages.conversion import CONVERT, Conversion

EVALUATE = "launcher_scripts.jobs.evaluation.evaluate"
EVALUATE_TUNED = "launcher_scripts.jobs.fine_tuning.evaluate_tuned"


@register
class Evaluation(StageDefaults):
    name = "evaluation"
    declared_keys = (
        Declared(
            optional=evaluate_tuned.OPTIONAL_KEYS,
            when=(
                ("evaluation_kind", "fine_tuned"),
                ("model_family", running("evaluation:fine_tuned")),
            ),
        ),
    )

    def validate(self, ctx: StageContext) -> None:
        cfg, stage = ctx.cfg, ctx.stage
        kind = cfg.get("evaluation_kind", "harness")
        require_choice(f"{stage}.evaluation_kind", kind, recipe.KINDS)
        family = family_of(cfg, stage)
        runnable = family.runs(f"evaluation:{kind}")
        require_job_program(ctx, "evaluation_kind", f"{kind} evaluation of {family.name}", runnable)
        if runnable and kind == "harness":
            self._validate_harness(ctx, family)
        elif runnable:
            self._validate_tuned(ctx, family)
        else:
            self._validate_layout(ctx)

    def _validate_tuned(self, ctx: StageContext, family: ModelFamily) -> None:
        cfg, stage = ctx.cfg, ctx.stage
        reader = evaluation_reader("fine_tuned", cfg.get("peft_method"))
        tp, pp = self._validate_layout(ctx)
        for key, path in self._tuned_inputs(cfg):
            if not path.exists() and not ctx.will_exist(path):
                raise ConfigError(
                    f"{stage}.{key}",
                    ctx.not_written(path),
                    "Run the tuning stage first, or point it at an existing file",
                )
        model_file = evaluate_tuned.model_file_of(cfg.model)
        inputs = dict(self._tuned_inputs(cfg))
        base_key = next(iter(inputs))
        model = None
        if model_file.is_file():
            model = recipe.portable_model_config(model_file, f"{stage}.{base_key}")
            require_family(model, family, f"{stage}.{base_key}", model_file, reader)
            require_layout(model, tp, pp, f"{stage}.model")
        for key in evaluate_tuned.PEFT_KEYS:
            path = inputs.get(f"model.{key}")
            if path is not None and path.is_file():
                tuned = require_peft(path, f"{stage}.model.{key}")
                if model is None:
                    require_peft_family(tuned, family, f"{stage}.model.{key}", path, reader)
                else:
                    require_pair(tuned, f"{stage}.model.{key}", path, model, model_file)

    @staticmethod
    def _tuned_inputs(cfg: Any) -> list[tuple[str, Path]]:
        model = cfg.model
        base_key = (
            "model.restore_from_path"
            if model.get("restore_from_path")
            else ("model.language_model_path")
        )
        inputs = [(base_key, evaluate_tuned.model_file_of(model))]
        for key in evaluate_tuned.PEFT_KEYS:
            if model.get(key):
                inputs.append((f"model.{key}", Path(str(model[key]))))
        return inputs + evaluate_tuned.test_files(cfg.data).inputs()

    @staticmethod
    def _validate_layout(ctx: StageContext) -> tuple[int, int]:
        cfg, stage = ctx.cfg, ctx.stage
        require_int(f"{stage}.model.eval_batch_size", cfg.model.eval_batch_size)
        require_choice(f"{stage}.run.accelerator", str(cfg.run.accelerator), ("gpu", "cpu"))
        tp = require_int(
            f"{stage}.model.tensor_model_parallel_size", cfg.model.tensor_model_parallel_size
        )
        pp = require_int(
            f"{stage}.model.pipeline_model_parallel_size", cfg.model.pipeline_model_parallel_size
        )
        return tp, pp

    def _validate_harness(self, ctx: StageContext, family: ModelFamily) -> None:
        cfg, stage = ctx.cfg, ctx.stage
        self._check_nemo_keys(ctx)
        if recipe.evaluates_checkpoint(cfg.model):
            model_file = self._validate_checkpoint(ctx, family)
        else:
            model_file = ctx.require_input(
                "nemo_model",
                "Convert first (stages=[conversion,evaluation]), set it to a .nemo file, or "
                "evaluate a training checkpoint with model.checkpoint_folder",
            )
        paths = recipe.include_paths(cfg.run.get("include_path"), f"{stage}.run.include_path")
        recipe.lm_eval_tasks(
            recipe.requested_names(cfg.run.tasks, f"{stage}.run.tasks"),
            recipe.user_task_names(paths),
            f"{stage}.run.tasks",
        )
        require_int(f"{stage}.run.bootstrap_iters", cfg.run.get("bootstrap_iters", 1000), 0)
        if cfg.run.get("num_fewshot") is not None:
            require_int(f"{stage}.run.num_fewshot", cfg.run.num_fewshot, 0)
        self._check_limit(f"{stage}.run.limit", cfg.run.get("limit"))
        tp, pp = self._validate_layout(ctx)
        model = self._model(ctx, model_file)
        if model is None:
            return
        if model_file.is_file():
            reader = evaluation_reader("harness", None)
            require_family(model, family, f"{stage}.model.nemo_model", model_file, reader)
        require_layout(model, tp, pp, f"{stage}.model")
        if model_file.is_file():
            recipe.check_precision(
                cfg.model.get("precision"), model.get("precision", 32), f"{stage}.model.precision"
            )

    @staticmethod
    def _check_nemo_keys(ctx: StageContext) -> None:
        """NeMo's keys of a training checkpoint's evaluation (checkpoint_name, hparams_file and
        the tokenizer files) only beside model.checkpoint_folder: a converted file holds its
        tokenizer; and model_parallel_size = TP x PP."""
        prefix = f"{ctx.stage}.model"
        if not recipe.evaluates_checkpoint(ctx.cfg.model):
            nemo_keys.require_unset(
                ctx.cfg.model,
                ("checkpoint_name", "hparams_file", "vocab_file", "merge_file"),
                prefix,
                "They describe the training checkpoint model.checkpoint_folder names: set it "
                "too, or leave them null to evaluate model.nemo_model (which holds its "
                "tokenizer)",
            )
        nemo_keys.check_model_parallel_size(ctx.cfg.model, prefix)

    @staticmethod
    def _validate_checkpoint(ctx: StageContext, family: ModelFamily) -> Path:
        """A training checkpoint to evaluate (NeMo's model.checkpoint_folder): checked as the
        conversion stage checks one, since this stage's first job converts it; the file that
        job writes is the one evaluated."""
        cfg, stage = ctx.cfg, ctx.stage
        model = cfg.model
        folder = Path(str(model.checkpoint_folder))
        hparams = hparams_path(model)
        for key, path in (("checkpoint_folder", folder), ("hparams_file", hparams)):
            if not path.exists() and not ctx.will_exist(path):
                raise ConfigError(
                    f"{stage}.model.{key}",
                    ctx.not_written(path),
                    "Give the training run's checkpoints folder (<explicit_log_dir>/checkpoints; "
                    "hparams.yaml is read beside it unless model.hparams_file names it)",
                )
        require_job_program(
            ctx, "model_family", f"{family.name} checkpoints", family.runs("conversion")
        )
        Conversion._check_checkpoint(ctx)
        trained = Conversion._trained_model(ctx)
        Conversion._check_tokenizer_files(ctx, trained[0] if trained else None)
        if trained is not None:
            problem = family_mismatch(trained[0], family.name, trained[1])
            if problem:
                raise RecipeError(f"{stage}.model_family: {problem}")
        return recipe.evaluated_file(cfg)

    @staticmethod
    def _check_limit(key: str, limit: Any) -> None:
        if limit is None:
            return
        if isinstance(limit, bool) or not isinstance(limit, int | float) or limit <= 0:
            raise ConfigError(
                key, f"{limit!r} is not a positive number", "Give a count, a share below 1, or null"
            )
        if isinstance(limit, float) and limit >= 1 and not limit.is_integer():
            raise ConfigError(key, f"{limit} is neither a count nor a share below 1", "Fix it")

    @staticmethod
    def _model(ctx: StageContext, model_file: Path) -> Any:
        """The model's section: from the file, or, when a conversion (this stage's own, or
        the conversion stage of this run) writes the file, from what it reads. None when
        neither can be read yet."""
        if recipe.evaluates_checkpoint(ctx.cfg.model):
            trained = Conversion._trained_model(ctx)
            return trained[0] if trained else None
        if model_file.is_file():
            return recipe.portable_model_config(model_file)
        if "conversion" in ctx.root:
            trained = Conversion._trained_model(
                StageContext(ctx.root, "conversion", ctx.upstream_writes)
            )
            return trained[0] if trained else None
        return None

    def jobs(self, ctx: StageContext) -> list[JobSpec]:
        cfg = ctx.cfg
        processes = int(cfg.model.tensor_model_parallel_size) * int(
            cfg.model.pipeline_model_parallel_size
        )
        on_gpu = str(cfg.run.accelerator) != "cpu"
        results = Path(str(cfg.run.results_dir))
        tuned = cfg.get("evaluation_kind", "harness") == "fine_tuned"
        program = EVALUATE_TUNED if tuned else EVALUATE
        reads = (
            tuple(str(path) for _, path in self._tuned_inputs(cfg))
            if tuned and family_of(cfg, ctx.stage).runs("evaluation:fine_tuned")
            else tuple(
                str(path)
                for path in (cfg.model.get("nemo_model"), cfg.model.get("restore_from_path"))
                if path
            )
        )
        jobs = []
        if not tuned and recipe.evaluates_checkpoint(cfg.model):
            converted = recipe.evaluated_file(cfg)
            folder = str(cfg.model.checkpoint_folder)
            argv = ("--config", str(ctx.config_path), f"--output={converted}")
            jobs.append(
                make_job(
                    ctx,
                    f"convert_{cfg.run.name}",
                    (Command(CONVERT, argv),),
                    # One process reads a checkpoint of any layout (as the conversion stage).
                    Resources(time_limit=str(cfg.run.time_limit)),
                    reads=(folder, str(hparams_path(cfg.model))),
                    writes=(str(converted),),
                )
            )
            reads = (str(converted),)
        return [
            *jobs,
            make_job(
                ctx,
                str(cfg.run.name),
                (Command(program, ("--config", str(ctx.config_path)), nproc_per_node=processes),),
                # Model parallelism only, within one node: every rank runs every request.
                Resources(
                    nodes=1,
                    ntasks_per_node=processes,
                    gpus_per_node=processes if on_gpu else 0,
                    time_limit=str(cfg.run.time_limit),
                    exclusive=on_gpu,
                    gpus_key=f"{ctx.stage}.model.tensor_model_parallel_size",
                ),
                reads=reads,
                writes=(str(results / "results.json"), str(results / "results.md")),
            ),
        ]
