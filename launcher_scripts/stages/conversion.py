"""The conversion stage: a training checkpoint to a portable file and a Hugging Face directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from launcher_scripts.config import nemo_keys
from launcher_scripts.config.checks import require_int, require_layout
from launcher_scripts.errors import ConfigError, HfImportError, RecipeError
from launcher_scripts.families import DEFAULT, FAMILIES, family_mismatch, family_of
from launcher_scripts.families.file_family import HF_EXPORT_READER, require_family, require_pair
from launcher_scripts.formats.portable_check import require_peft, require_portable
from launcher_scripts.formats.safetensors_stream import INDEX, SINGLE, SafetensorsError
from launcher_scripts.jobspec import Command, JobSpec, Resources
from launcher_scripts.recipes.conversion import (
    TOKENIZER_FILES,
    ConversionError,
    checkpoint_name,
    hparams_path,
    pick_checkpoint,
    read_hparams,
)
from launcher_scripts.stages.base import (
    StageContext,
    StageDefaults,
    make_job,
    register,
    require_job_program,
)
from launcher_scripts.tuning import METHODS, merging_titles

CONVERT = "launcher_scripts.jobs.conversion.convert"
HF_IMPORT = "launcher_scripts.jobs.conversion.hf_import"
HF_EXPORT = "launcher_scripts.jobs.conversion.hf_export"


def importing(cfg: Any) -> bool:
    """Whether the recipe imports a Hugging Face directory (conversion=hf_import)."""
    return "hf_model_dir" in cfg


def exporting(cfg: Any) -> bool:
    """Whether the recipe writes a portable file as a Hugging Face directory (hf_export)."""
    return "nemo_file" in cfg


def _check_output_name(cfg: Any, stage: str) -> None:
    if not str(cfg.run.nemo_file_name).endswith(".nemo"):
        raise ConfigError(
            f"{stage}.run.nemo_file_name", "does not end in .nemo", "Name it e.g. model.nemo"
        )


@register
class Conversion(StageDefaults):
    name = "conversion"

    def validate(self, ctx: StageContext) -> None:
        cfg, stage = ctx.cfg, ctx.stage
        if importing(cfg):
            self._validate_import(ctx)
            return
        if exporting(cfg):
            self._validate_export(ctx)
            return
        for name in ("checkpoint_folder", "hparams_file"):
            ctx.require_input(
                name,
                f"Train first (stages=[training,conversion]), or set {stage}.run."
                "model_train_name to the training run to convert",
            )
        _check_output_name(cfg, stage)
        tp = require_int(
            f"{stage}.model.tensor_model_parallel_size", cfg.model.tensor_model_parallel_size
        )
        pp = require_int(
            f"{stage}.model.pipeline_model_parallel_size", cfg.model.pipeline_model_parallel_size
        )
        nemo_keys.check_model_parallel_size(cfg.model, f"{stage}.model")
        family = family_of(cfg, stage)
        converted = family.runs("conversion")
        require_job_program(ctx, "model_family", f"{family.name} checkpoints", converted)
        if converted:
            self._check_checkpoint(ctx)
        trained = self._trained_model(ctx) if converted else None
        if converted:
            self._check_tokenizer_files(ctx, trained[0] if trained else None)
        if trained is None:
            return
        model, model_key = trained
        problem = family_mismatch(model, family.name, model_key)
        if problem:
            raise RecipeError(f"{stage}.model_family: {problem}")
        require_layout(model, tp, pp, f"{stage}.model")
        if cfg.run.get("hf_dir_name"):
            if family.hf_architecture is None:
                raise ConfigError(
                    f"{stage}.run.hf_dir_name",
                    f"{family.name} models have no Hugging Face export in this version",
                    "Set it to null",
                )
            family.hf_architecture(model, key_prefix=model_key)

    @staticmethod
    def _validate_import(ctx: StageContext) -> None:
        """A Hugging Face directory of a family that imports it, at a layout its model takes."""
        cfg, stage = ctx.cfg, ctx.stage
        _check_output_name(cfg, stage)
        # Its config.json's model_type; one line naming hf_model_dir if unreadable or unknown.
        family = family_of(cfg, stage)
        require_job_program(
            ctx, "hf_model_dir", f"{family.name} models from Hugging Face", family.runs("hf_import")
        )
        tp, pp = (
            require_int(f"{stage}.model.{name}", cfg.model[name])
            for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size")
        )
        divisor = cfg.model.get("make_vocab_size_divisible_by", 1)
        require_int(f"{stage}.model.make_vocab_size_divisible_by", divisor)
        directory = Path(str(cfg.hf_model_dir))
        config = json.loads((directory / "config.json").read_text())  # family_of read it
        section = None
        try:
            if family.hf_import_section is not None:
                section = family.hf_import_section(config)
        except HfImportError as error:
            raise ConfigError(
                f"{stage}.hf_model_dir",
                f"{directory}: {error}",
                "Import a model without it (this version refuses what it cannot compute exactly)",
            ) from None
        # The weights against the config and the tokenizer; a directory without weights is
        # left to the job, which says what to save there. The message says how to fix it.
        weights = any((directory / name).is_file() for name in (INDEX, SINGLE))
        if family.hf_import_check is not None and weights:
            try:
                family.hf_import_check(directory, config)
            except (HfImportError, SafetensorsError) as error:
                raise RecipeError(f"{stage}.hf_model_dir: {directory}: {error}") from None
        # The vocabulary rows need not divide over TP: the import pads them (hf_import).
        if section is not None:
            require_layout(OmegaConf.create(section), tp, pp, f"{stage}.model")

    @staticmethod
    def _validate_export(ctx: StageContext) -> None:
        """A whole portable file of a family with a Hugging Face export, whose model that
        export holds exactly; a LoRA file to fold in first, if any."""
        cfg, stage = ctx.cfg, ctx.stage
        family = family_of(cfg, stage)  # `auto`: the file's, which it checked is readable
        if family.hf_architecture is None:
            exported = sorted(f.name for f in FAMILIES.values() if f.hf_architecture)
            raise ConfigError(
                f"{stage}.nemo_file",
                f"{family.name} models have no Hugging Face export in this version",
                f"Export a model of one of: {', '.join(exported)}",
            )
        model_file = Path(str(cfg.nemo_file))
        model = None
        if model_file.exists() or not ctx.will_exist(model_file):
            model = require_portable(model_file, f"{stage}.nemo_file")
            require_family(model, family, f"{stage}.nemo_file", model_file, HF_EXPORT_READER)
            family.hf_architecture(model, key_prefix=f"{model_file} model")
        peft = cfg.get("peft_file")
        if peft is None:
            return
        peft_path = Path(str(peft))
        if peft_path.exists() or not ctx.will_exist(peft_path):
            tuned = require_peft(peft_path, f"{stage}.peft_file")
            scheme = tuned.peft.get("scheme")
            method = METHODS.get(str(scheme))
            if method is None or not method.merges:
                folding = merging_titles()
                raise ConfigError(
                    f"{stage}.peft_file",
                    f"{peft_path} holds {scheme}, and only {folding} folds into the weights",
                    f"Give a {folding} PEFT file, or set it to null to export the base model",
                )
            if model is not None:
                require_pair(tuned, f"{stage}.peft_file", peft_path, model, model_file)

    @staticmethod
    def _check_checkpoint(ctx: StageContext) -> None:
        """The checkpoint to convert is there and whole, when no earlier stage of this run
        writes the folder: checked before the job replaces the last good outputs (the job
        checks again when it starts)."""
        folder = Path(str(ctx.cfg.model.checkpoint_folder))
        if not folder.is_dir() or ctx.written_upstream(folder):
            return
        try:
            pick_checkpoint(folder, checkpoint_name(ctx.cfg.model))
        except ConversionError as error:
            key = error.key.replace("conversion.", f"{ctx.stage}.", 1)
            raise RecipeError(f"{key}: {error}") from None

    @staticmethod
    def _check_tokenizer_files(ctx: StageContext, trained: Any) -> None:
        """model.vocab_file / merge_file (NeMo's keys) replace the GPT-2 BPE files training
        recorded: they must exist, and the trained tokenizer must be one made of such files."""
        for name in TOKENIZER_FILES:
            value = ctx.cfg.model.get(name)
            if value is None:
                continue
            key = f"{ctx.stage}.model.{name}"
            recorded = (trained.get("tokenizer") or {}) if trained is not None else None
            if recorded is not None and recorded.get(name) is None:
                raise ConfigError(
                    key,
                    f"the trained model's tokenizer has no {name} (it is "
                    f"{recorded.get('model') or recorded.get('library')}), and it is packed as "
                    "training recorded it",
                    f"Set {key}=null",
                )
            ctx.require_input(name, "Give the path of the tokenizer file the model trained with")

    @staticmethod
    def _trained_model(ctx: StageContext) -> tuple[Any, str] | None:
        """The trained model's section and the key to name in errors: from its hparams file,
        or from the training recipe of this same run when that writes the file."""
        hparams = hparams_path(ctx.cfg.model)
        if hparams.is_file():
            return read_hparams(hparams), str(hparams)
        if ctx.will_exist(hparams) and "training" in ctx.root:
            training = ctx.root.training
            model = OmegaConf.merge(
                training.model, {"model_family": training.get("model_family", DEFAULT)}
            )
            return model, "training.model"
        return None

    def jobs(self, ctx: StageContext) -> list[JobSpec]:
        cfg = ctx.cfg
        output = Path(str(cfg.run.output_path))
        if exporting(cfg):
            program = HF_EXPORT
            reads = tuple(str(cfg[name]) for name in ("nemo_file", "peft_file") if cfg[name])
            writes = [str(output)]  # the Hugging Face directory itself
        elif importing(cfg):
            program, reads = HF_IMPORT, (str(cfg.hf_model_dir),)
            writes = [str(output / str(cfg.run.nemo_file_name))]
        else:
            program = CONVERT
            reads = (str(cfg.model.checkpoint_folder), str(cfg.model.hparams_file))
            writes = [str(output / str(cfg.run.nemo_file_name))]
            if cfg.run.get("hf_dir_name"):
                writes.append(str(output / str(cfg.run.hf_dir_name)))
        return [
            make_job(
                ctx,
                str(cfg.run.name),
                (Command(program, ("--config", str(ctx.config_path))),),
                # One process reads a checkpoint of any layout: no GPUs, no exclusive node.
                Resources(time_limit=str(cfg.run.time_limit)),
                reads=reads,
                writes=tuple(writes),
            )
        ]
