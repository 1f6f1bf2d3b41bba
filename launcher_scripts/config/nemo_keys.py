"""Keys and values the NeMo launcher's documentation uses that this launcher names otherwise or
does not need, each with the one line that says what to use instead.

The keys NeMo documents with the same meaning here are in the shipped recipes (with a comment
where the name is NeMo's, e.g. conversion.model.vocab_file, data_preparation.run.array,
the T5 recipes' model.position_embedding_type); this module holds the rest, so a command or a
recipe file written for NeMo fails on its first such key with the fix, not with "unknown key".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from launcher_scripts.errors import ConfigError


@dataclass(frozen=True)
class Refused:
    group: str  # the config group ("" for the root)
    path: str  # the key within the group's section
    problem: str
    fix: str
    when: tuple[tuple[str, str], ...] = ()  # discriminator values it is limited to

    def matches(self, group: str, path: str, kind: Mapping[str, Any]) -> bool:
        return (
            self.group == group
            and self.path == path
            and all(kind.get(name) == value for name, value in self.when)
        )


ONE_PROCESS = "the conversion job is one process on one node, whatever the checkpoint's layout"
EVAL_PROCESSES = "evaluation runs TP x PP processes on one node"
EVAL_LAYOUT = (
    "Set evaluation.model.tensor_model_parallel_size and pipeline_model_parallel_size instead"
)
PILE_WORKERS = "Set data_preparation.run.workers_per_node (tokenizing processes per node)"
TUNED_FILE = (
    "the tuned file is model.virtual_prompt_model_file (prompt learning), "
    "model.adapter_model_file (adapters, IA3) or model.peft_model_file (LoRA), and the base "
    "model model.language_model_path or model.restore_from_path"
)

FASTER_TRANSFORMER = (
    "is FasterTransformer's (NeMo's Triton backend, archived upstream); the export here serves "
    "the converted file through the model server"
)
SERVED_PRECISION = (
    "Remove it: the model serves in the precision it was trained and converted in (the .nemo "
    "file records it; bf16 from a GPU run)"
)
FT_EXPORT_KEYS = (
    ("model.weight_data_type", SERVED_PRECISION),
    ("triton_deployment.data_type", SERVED_PRECISION),
    ("triton_deployment.int8_mode", "Remove it: int8 weights are not served here"),
    ("triton_deployment.enable_custom_all_reduce", "Remove it: TP ranks reduce with NCCL"),
    ("model.processes", "Remove it: the export job is one process that writes the repository"),
    ("model.load_checkpoints_to_cpu", "Remove it: the export reads the converted file"),
    (
        "triton_deployment.triton_model_dir",
        "Set export.triton_deployment.model_repository and model_name instead",
    ),
)

STEP_TIMING = "train_step_timing is the mean over the steps since the previous log line"
TRAINING_GROUPS = ("training", "fine_tuning", "peft", "dpo", "grpo", "rlhf_ppo", "rlhf_rm")

REFUSED: tuple[Refused, ...] = (
    *(
        Refused(
            group,
            "exp_manager.step_timing_kwargs.buffer_size",
            f"is NeMo's smoothing window of the step time; here {STEP_TIMING}",
            "Remove it, and set trainer.log_every_n_steps to change the window",
        )
        for group in TRAINING_GROUPS
    ),
    *(
        Refused(
            group,
            "model.apex_transformer_log_level",
            "is the log level of Apex's transformer module, which this launcher does not use",
            "Remove it",
        )
        for group in TRAINING_GROUPS
    ),
    *(Refused("export", key, FASTER_TRANSFORMER, fix) for key, fix in FT_EXPORT_KEYS),
    Refused("conversion", "run.nodes", f"is NeMo's; {ONE_PROCESS}", "Remove it"),
    Refused("conversion", "run.ntasks_per_node", f"is NeMo's; {ONE_PROCESS}", "Remove it"),
    Refused("evaluation", "run.nodes", f"is NeMo's; {EVAL_PROCESSES}", EVAL_LAYOUT),
    Refused("evaluation", "run.ntasks_per_node", f"is NeMo's; {EVAL_PROCESSES}", EVAL_LAYOUT),
    Refused(
        "evaluation",
        "model.nemo_model",
        f"is NeMo's name for a fine-tuned evaluation's file; here {TUNED_FILE}",
        "Set the key of this recipe",
        (("evaluation_kind", "fine_tuned"),),
    ),
    Refused(
        "data_preparation",
        "run.bcp_preproc_npernode",
        "is NeMo's processes per node on Base Command Platform",
        PILE_WORKERS,
    ),
    Refused(
        "data_preparation",
        "bcp_preproc_npernode",
        "is NeMo's processes per node on Base Command Platform",
        PILE_WORKERS,
    ),
    Refused(
        "data_preparation",
        "nodes",
        "is NeMo's older name",
        "Set data_preparation.run.node_array_size (cluster tasks sharing the work)",
    ),
    Refused(
        "data_preparation",
        "time_limit",
        "is NeMo's older name",
        "Set data_preparation.run.time_limit",
    ),
    Refused(
        "data_preparation",
        "log_dir",
        "is NeMo's older name: logs are written to run.results_dir",
        "Set data_preparation.run.results_dir",
    ),
    *(
        Refused(
            "data_preparation",
            name,
            "is one of NeMo's mC4 working folders, which this launcher does not need (it reads "
            "the downloaded files from c4_dir and shares them out by task)",
            "Remove it",
            (("dataset", "mc4"),),
        )
        for name in ("git_lfs_dir", "softlinks_dir")
    ),
    Refused(
        "data_preparation",
        "max_split_size",
        "is NeMo's size in GB of each mC4 preprocessing split; here the downloaded files are "
        "shared out whole, by task and then by worker",
        "Remove it, and set data_preparation.run.node_array_size and run.workers_per_node",
        (("dataset", "mc4"),),
    ),
    *(
        Refused(
            "data_preparation",
            name,
            "is NeMo's file mapping mC4 files to workers; here task i of run.node_array_size "
            "takes every node_array_size-th file, so no mapping is written or read",
            "Remove it",
            (("dataset", "mc4"),),
        )
        for name in ("download_worker_mapping", "preprocess_worker_mapping")
    ),
)


def refusal(group: str, path: str, kind: Mapping[str, Any]) -> tuple[str, str] | None:
    """(problem, fix) for a NeMo key of `group` that this launcher refuses, else None."""
    for refused in REFUSED:
        if refused.matches(group, path, kind):
            return refused.problem, refused.fix
    return None


def check_model_parallel_size(model: Mapping[str, Any], key_prefix: str) -> None:
    """NeMo's `model_parallel_size` is derived: TP x PP. A value that is not their product
    would say one layout and run another."""
    given = model.get("model_parallel_size")
    if given is None:
        return
    tensor = model.get("tensor_model_parallel_size")
    pipeline = model.get("pipeline_model_parallel_size")
    if isinstance(tensor, int) and isinstance(pipeline, int) and given != tensor * pipeline:
        raise ConfigError(
            f"{key_prefix}.model_parallel_size",
            f"{given!r} is not tensor_model_parallel_size x pipeline_model_parallel_size "
            f"= {tensor} x {pipeline}",
            f"Set {key_prefix}.tensor_model_parallel_size and pipeline_model_parallel_size "
            "(model_parallel_size follows from them)",
        )


def require_unset(
    section: Mapping[str, Any], names: tuple[str, ...], key_prefix: str, fix: str
) -> None:
    """NeMo keys a recipe keeps so NeMo's commands that null them run; any other value is
    refused with `fix`."""
    for name in names:
        if section.get(name) is not None:
            raise ConfigError(f"{key_prefix}.{name}", "is NeMo's and only null is accepted", fix)
