"""The export job: a portable file, with a LoRA file folded in if given, to a Hugging Face
transformers directory.

    python -m launcher_scripts.jobs.conversion.hf_export --config <results_dir>/<name>_hydra.yaml

The family's Hugging Face writer (the one the conversion stage uses) maps our tensors to the
architecture that holds the model exactly. The directory is built beside the old one and
replaces it whole, so a failed export keeps the last good one.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from omegaconf import DictConfig

from launcher_scripts.jobs.config_job import run_config_job


def hf_export(cfg: DictConfig) -> None:
    from launcher_scripts.errors import ConfigError
    from launcher_scripts.families.file_family import pair_problem
    from launcher_scripts.files import replaced_directory
    from launcher_scripts.formats import portable
    from launcher_scripts.formats.portable_check import inspect_peft, inspect_portable
    from launcher_scripts.jobs.conversion.convert import write_hf_files
    from launcher_scripts.jobs.fine_tuning import peft_file
    from launcher_scripts.jobs.fine_tuning.merge_lora import merged

    model_file = Path(str(cfg.nemo_file))
    lora_file = Path(str(cfg.peft_file)) if cfg.get("peft_file") else None
    # Both whole before anything is loaded or written (preflight may have run before an
    # earlier stage wrote them).
    base = inspect_portable(model_file).config
    if lora_file is not None:
        problem = pair_problem(inspect_peft(lora_file).config, lora_file, base, model_file)
        if problem is not None:
            raise ConfigError("conversion.peft_file", *problem)
    output = Path(str(cfg.run.output_path))
    with tempfile.TemporaryDirectory() as scratch:
        loaded = portable.read(model_file, Path(scratch))
        tensors = loaded.tensors
        if lora_file is not None:
            lora = peft_file.read(lora_file)
            tensors = merged(tensors, lora.tensors, lora.settings)
            print(f"merged LoRA from {lora_file} (rank {lora.settings.rank})", flush=True)
        with replaced_directory(output) as partial:
            write_hf_files(partial, loaded.config, tensors)
    print(f"wrote {output} (Hugging Face transformers) from {model_file}", flush=True)


def _input_errors() -> tuple[type[BaseException], ...]:
    from launcher_scripts.errors import ConfigError
    from launcher_scripts.formats.portable_check import PortableFileError
    from launcher_scripts.jobs.fine_tuning.merge_lora import MergeError

    return (ConfigError, PortableFileError, MergeError, OSError)


def main(argv: list[str] | None = None) -> int:
    return run_config_job(argv, __doc__.splitlines()[0], "conversion", hf_export, _input_errors)


if __name__ == "__main__":
    sys.exit(main())
