"""Continued pretraining's start: the portable file a training recipe restores from
(recipes/restore.py says what the file decides), opened by every rank of the job.

Every rank checks the file (it reads a few kilobytes) so that all fail alike on a bad one;
rank 0 extracts its tokenizer to `<log dir>/restored/`, where the run's hparams.yaml points
for the conversion stage to find it; the tensors stay in the file until each rank reads the
layers it holds (init_weights.load_full_tensors).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from launcher_scripts.families import family_of
from launcher_scripts.families.file_family import RESTORE_READER, family_problem
from launcher_scripts.files import replaced_directory
from launcher_scripts.formats import portable
from launcher_scripts.formats.portable import EMBEDDINGS
from launcher_scripts.formats.portable_check import PortableFileError, inspect_portable
from launcher_scripts.jobs.training.runtime import JobError
from launcher_scripts.recipes import restore

TOKENIZER_HOME = "restored"


def open_restored(cfg: Any, stage: str = "training") -> portable.Portable | None:
    """The file of `<stage>.model.restore_from_path`, or None for a run from random weights.
    cfg.model becomes the model the job builds: the file's architecture and tokenizer."""
    path = restore.restore_path(cfg.model)
    if path is None:
        return None
    where = f"{stage}.{restore.RESTORE_KEY}"
    try:
        summary = inspect_portable(path)
    except PortableFileError as error:
        raise JobError(f"{where}: {error}") from None
    problem = family_problem(summary.config, family_of(cfg, stage), path, RESTORE_READER)
    if problem is not None:
        raise JobError(f"{where}: {'. '.join(problem)}")
    home = Path(str(cfg.exp_manager.explicit_log_dir)) / TOKENIZER_HOME
    if dist.get_rank() == 0:
        with replaced_directory(home) as partial:
            portable.read(Path(path), partial)
    dist.barrier()
    opened = portable.read(Path(path), home, extract=False)
    rows = summary.shapes[EMBEDDINGS][0]
    cfg.model = restore.restored_model(cfg.model, opened.config, rows, stage)
    return opened
