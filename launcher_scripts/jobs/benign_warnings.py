"""Silence the warnings every job log would otherwise start with, which users read as errors.

megatron-core says at import that Transformer Engine and Apex are missing (the CPU path and a
plain PyTorch install use its local fallbacks on purpose), warns about its own default
`cuda_graph_scope`, logs WARNING lines about its rerun state machine and single-dataset
blends, and calls torch functions that torch has deprecated. None of them asks the user to do
anything. Each is matched by its text (and category or logger), so any other warning, from
megatron-core or elsewhere, still shows.

SentencePiece's trainer, left at its INFO level, starts with absl's "WARNING: All log messages
before absl::InitializeLog() ..." and dumps its whole trainer spec: the tokenizer job keeps it
to warnings and errors (`showing_all()`).

LAUNCHER_SHOW_ALL_WARNINGS=1 in a job's environment keeps them all (env_vars in the config).
`launcher_scripts/jobs/__init__.py` installs this, so it runs before a job program imports
megatron-core: Python imports a package before any of its modules.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

SWITCH = "LAUNCHER_SHOW_ALL_WARNINGS"

# (category, message regex, module regex of where the warning is reported)
BENIGN_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (UserWarning, r"Transformer Engine and Apex are not installed\. Falling back", r"megatron\."),
    (UserWarning, r"Apex is not installed\. Falling back to Torch Norm", r"megatron\."),
    (UserWarning, r"full scope is deprecated\. Use empty cuda_graph_scope", r"megatron\."),
    # megatron-core's checkpoint strategy calls torch.distributed.checkpoint's old names.
    (FutureWarning, r"`(load|save)_state_dict` is deprecated", r"megatron\."),
    # ... and its distributed optimizer the old collective names (reported inside torch).
    (
        FutureWarning,
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        r"torch\.distributed\.",
    ),
    # megatron-core's optimizer looks at .grad of every parameter it zeroes, a view among them;
    # on a CPU run that access goes through the CUDA-to-CPU redirection, which reports it.
    (
        UserWarning,
        r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
        r"launcher_scripts\.jobs\.training\.cpu_compat",
    ),
)

# logger name -> messages (regexes) it logs at WARNING that ask nothing of the user.
BENIGN_LOG_LINES: dict[str, tuple[str, ...]] = {
    "megatron.core.rerun_state_machine": (
        r"Implicit initialization of Rerun State Machine!",
        r"RerunStateMachine initialized in mode RerunMode\.DISABLED",
    ),
    "megatron.core.datasets.blended_dataset": (
        r"Building a BlendedDataset for a single MegatronDataset",
    ),
}


class _DropLines(logging.Filter):
    def __init__(self, patterns: tuple[str, ...]) -> None:
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def showing_all() -> bool:
    """Whether the user asked for every warning and library log line (the debug switch)."""
    return os.environ.get(SWITCH) == "1"


def install() -> None:
    """Add the filters (once per process); nothing when LAUNCHER_SHOW_ALL_WARNINGS=1."""
    if showing_all():
        return
    for category, message, module in BENIGN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, patterns in BENIGN_LOG_LINES.items():
        logger = logging.getLogger(name)  # the same object megatron-core's module gets later
        if not any(isinstance(f, _DropLines) for f in logger.filters):
            logger.addFilter(_DropLines(patterns))
