"""The export stage: a portable checkpoint to a Triton model repository that serves it."""

from __future__ import annotations

import re
from pathlib import Path

from launcher_scripts.config.checks import (
    require_choice,
    require_int,
    require_layout,
    require_row_split,
)
from launcher_scripts.errors import ConfigError
from launcher_scripts.families import family_of
from launcher_scripts.families.file_family import EXPORT_READER, require_family
from launcher_scripts.formats.portable import EMBEDDINGS
from launcher_scripts.formats.portable_check import inspect_portable, require_portable
from launcher_scripts.jobspec import Command, JobSpec, Resources
from launcher_scripts.recipes import lambada
from launcher_scripts.recipes.generation_params import GenerationParams
from launcher_scripts.recipes.triton_interface import (
    PARAMETER_NAMES,
    STREAM_SUFFIX,
    VLLM_DTYPES,
    generation_defaults,
)
from launcher_scripts.stages.base import (
    StageContext,
    StageDefaults,
    make_job,
    register,
    require_job_program,
)

EXPORT = "launcher_scripts.jobs.export.export"
MODEL_NAME = re.compile(r"[A-Za-z0-9_-]+")


def check_layout(model_file: Path, tensor: int, pipeline: int, stage: str) -> None:
    """The served layout divides the file's model: TP its heads and embedding rows (the
    reference's export.model key), PP its layers (export.triton_deployment's)."""
    summary = inspect_portable(model_file)
    require_layout(summary.config, tensor, 1, f"{stage}.model")
    require_layout(summary.config, 1, pipeline, f"{stage}.triton_deployment")
    rows = summary.shapes[EMBEDDINGS][0]
    require_row_split(rows, tensor, f"{stage}.model", "the file's")


def vllm_writes(cfg: object, name: str) -> tuple[str, ...]:
    vllm = cfg.get("vllm")  # type: ignore[attr-defined]
    if vllm is None or not vllm.enabled:
        return ()
    return (str(Path(str(vllm.model_repository)) / name),)


@register
class Export(StageDefaults):
    name = "export"

    def validate(self, ctx: StageContext) -> None:
        cfg, stage = ctx.cfg, ctx.stage
        family = family_of(cfg, stage)
        require_job_program(ctx, "model_family", f"{family.name} models", family.runs("export"))
        require_int(
            f"{stage}.triton_deployment.max_request_tokens",
            cfg.triton_deployment.max_request_tokens,
            minimum=1,
        )
        model_file = ctx.require_input(
            "nemo_file", "Convert first (stages=[conversion,export]), or point it at a .nemo file"
        )
        tensor = require_int(
            f"{stage}.model.tensor_model_parallel_size", cfg.model.tensor_model_parallel_size
        )
        pipeline = require_int(
            f"{stage}.triton_deployment.pipeline_model_parallel_size",
            cfg.triton_deployment.pipeline_model_parallel_size,
        )
        if model_file.exists() and not ctx.written_upstream(model_file):
            # Before the job replaces a repository that serves: a file that cannot be served
            # (cut short, a PEFT file, another family's model, a layout that does not divide
            # it) is refused here.
            key = f"{stage}.model.nemo_file"
            model = require_portable(model_file, key)
            require_family(model, family, key, model_file, EXPORT_READER)
            check_layout(model_file, tensor, pipeline, stage)
        name = str(cfg.triton_deployment.model_name)
        if not MODEL_NAME.fullmatch(name):
            raise ConfigError(
                f"{stage}.triton_deployment.model_name",
                f"{name!r} is not a Triton model name",
                "Use letters, digits, _ and - only",
            )
        require_int(
            f"{stage}.triton_deployment.max_batch_size", cfg.triton_deployment.max_batch_size
        )
        require_int(
            f"{stage}.triton_deployment.max_queue_delay_microseconds",
            cfg.triton_deployment.max_queue_delay_microseconds,
            minimum=0,
        )
        self._check_generation(ctx)
        lambada.check_section(ctx.cfg.check, ctx.will_exist)
        self._check_vllm(ctx)

    @staticmethod
    def _check_vllm(ctx: StageContext) -> None:
        """The vLLM repository's inputs, when it is asked for (export.vllm.enabled)."""
        vllm = ctx.cfg.get("vllm")
        if vllm is None or not vllm.enabled:
            return
        key = f"{ctx.stage}.vllm"
        require_choice(f"{key}.dtype", str(vllm.dtype), VLLM_DTYPES)
        share = vllm.gpu_memory_utilization
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
            raise ConfigError(
                f"{key}.gpu_memory_utilization", f"{share!r} is not in (0, 1]", "Use e.g. 0.9"
            )
        if vllm.max_model_len is not None:
            require_int(f"{key}.max_model_len", vllm.max_model_len)
        hf_dir = Path(str(vllm.hf_dir))
        if not (hf_dir / "config.json").is_file() and not ctx.will_exist(hf_dir):
            raise ConfigError(
                f"{key}.hf_dir",
                f"{hf_dir} holds no Hugging Face model (config.json)",
                "Convert with conversion.run.hf_dir_name set (stages=[conversion,export]), "
                "or point it at a Hugging Face directory",
            )

    @staticmethod
    def _check_generation(ctx: StageContext) -> None:

        section = ctx.cfg.generation
        missing = [name for name in PARAMETER_NAMES if name not in section]
        if missing:
            raise ConfigError(
                f"{ctx.stage}.generation.{missing[0]}",
                "is missing",
                f"Set it (the keys are {', '.join(PARAMETER_NAMES)})",
            )
        try:
            GenerationParams(**generation_defaults(ctx.cfg)).check()
        except ValueError as error:
            field, _, message = str(error).partition(": ")
            raise ConfigError(
                f"{ctx.stage}.generation.{field}", message, "Change it to an allowed value"
            ) from None

    def jobs(self, ctx: StageContext) -> list[JobSpec]:
        cfg = ctx.cfg
        repository = Path(str(cfg.triton_deployment.model_repository))
        name = str(cfg.triton_deployment.model_name)
        return [
            make_job(
                ctx,
                str(cfg.run.name),
                (Command(EXPORT, ("--config", str(ctx.config_path))),),
                # One process writes the repository and loads the model once to check it.
                Resources(time_limit=str(cfg.run.time_limit)),
                reads=(str(cfg.model.nemo_file),),
                writes=(
                    str(repository / name),
                    str(repository / f"{name}{STREAM_SUFFIX}"),
                    *vllm_writes(cfg, name),
                ),
            )
        ]
