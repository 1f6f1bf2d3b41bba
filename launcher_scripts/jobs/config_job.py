"""The command line every stage job shares: `python -m <job> --config <resolved stage yaml>`,
with the job's known input errors reported as one line and exit code 1 (a traceback is kept
for bugs)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from omegaconf import DictConfig, OmegaConf

from launcher_scripts.errors import ConfigError
from launcher_scripts.families import family_of
from launcher_scripts.jobs.refusal import refuse


def run_config_job(
    argv: list[str] | None,
    description: str,
    stage: str,
    job: Callable[[DictConfig], None],
    input_errors: Callable[[], tuple[type[BaseException], ...]],
    program: str | None = None,
) -> int:
    """`input_errors` returns the exception types that mean bad inputs; it is called after the
    arguments are parsed, so `--help` does not wait for the imports it needs. `program`: the
    families.PROGRAMS entry this job is (default: `stage`); a recipe whose model family has no
    such job program in this version is refused (as preflight does)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help=f"the {stage} stage's resolved config")
    args = parser.parse_args(argv)
    cfg = OmegaConf.load(args.config)
    assert isinstance(cfg, DictConfig)
    try:
        family = family_of(cfg, stage)
    except ConfigError as error:  # an `auto` recipe's Hugging Face directory, gone since
        return refuse(error)
    if not family.runs(program or stage):
        return refuse(
            f"{stage}.model_family: this launcher version has no {stage} job program for "
            f"{family.name} models yet"
        )
    errors = input_errors()
    try:
        job(cfg)
    except errors as error:
        return refuse(error)
    return 0
