"""Weights & Biases logging of a training or tuning run: one W&B run per training, continued
across resumes and requeues.

The API key is read from the file named by WANDB_API_KEY_FILE (the launcher's
`wandb_api_key_file`) and stays in memory: it is given to the run, not saved by a login. No
error here shows that file's name: a key pasted where its path belongs would otherwise end up in
the job's log.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
from pathlib import Path
from typing import Any

from launcher_scripts.files import write_atomic
from launcher_scripts.jobs.training.runtime import JobError

KEY_FILE_VARIABLE = "WANDB_API_KEY_FILE"
# Beside the checkpoints in the run's log dir: a resumed or requeued job continues this W&B run.
RUN_ID_FILE = "wandb_run_id"


def wanted(exp_manager: Any) -> bool:
    return bool(exp_manager.get("create_wandb_logger"))


def check_ready(exp_manager: Any, stage: str) -> None:
    """At the job's start, before any work: wandb importable and the key file readable when
    the recipe asks for W&B. The launcher checks this in preflight when the job runs in its own
    environment; in a container image, only the job can."""
    if not wanted(exp_manager):
        return
    if importlib.util.find_spec("wandb") is None:
        raise JobError(
            f"{stage}.exp_manager.create_wandb_logger is true but wandb is not installed where "
            "this job runs (its container image or Python environment): install it there "
            "(pip install wandb) or set create_wandb_logger=False"
        )
    if os.environ.get(KEY_FILE_VARIABLE):
        read_key()


def read_key() -> str:
    """The key from WANDB_API_KEY_FILE; the error names the setting, never the file."""
    try:
        key = Path(os.environ[KEY_FILE_VARIABLE]).read_text().strip()
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or type(error).__name__
        raise JobError(
            f"wandb_api_key_file: the file it names cannot be read here ({reason}; the name is "
            "not shown, in case it is a key): give the path of a file holding the W&B API key, "
            "readable where the job runs"
        ) from None
    if not key:
        raise JobError("wandb_api_key_file: the file it names is empty: put the W&B API key in it")
    return key


def open_run(exp_manager: Any, run_name: str, log_dir: Path, resumed: bool) -> Any:
    """A W&B run when the recipe asks for one and a key file is given, else None.

    `resumed`: this job continues a checkpoint of the same training, so it continues the W&B
    run recorded in `log_dir` (requeued and resumed jobs make one run in W&B, not one each);
    a fresh training starts a new W&B run and records its id.
    """
    if not wanted(exp_manager):
        return None
    if not os.environ.get(KEY_FILE_VARIABLE):
        print("note: create_wandb_logger is set but no wandb_api_key_file was given; W&B is off")
        return None
    try:
        import wandb
    except ImportError:
        raise JobError(
            "exp_manager.create_wandb_logger is true but wandb is not installed where this job "
            "runs: install it there (pip install wandb) or set create_wandb_logger=False"
        ) from None
    kwargs = dict(exp_manager.get("wandb_logger_kwargs") or {})
    kwargs.setdefault("name", run_name)
    if not kwargs.get("id"):  # an id the recipe sets is the user's to manage
        kwargs["id"] = run_id(log_dir, resumed)
    # The key as a setting of this run, not wandb.login(key=...), which saves it to ~/.netrc.
    settings = wandb.Settings(api_key=read_key())
    return wandb.init(dir=str(log_dir), resume="allow", settings=settings, **kwargs)


def run_id(log_dir: Path, resumed: bool) -> str:
    """The recorded id when resuming (and one is recorded), else a new one, recorded."""
    record = log_dir / RUN_ID_FILE
    if resumed and record.is_file():
        recorded = record.read_text().strip()
        if recorded:
            return recorded
    fresh = secrets.token_hex(6)  # unique in the project; none of the characters W&B forbids
    write_atomic(record, f"{fresh}\n")
    return fresh
