"""The evaluation recipe as typed values: which lm-eval tasks its names mean, where the task
files are, and the model a portable file holds. Shared by the stage's preflight and the job,
so it imports neither torch nor lm-eval."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig

from launcher_scripts.errors import ConfigError
from launcher_scripts.formats.portable_check import require_portable
from launcher_scripts.recipes.precision import PRECISIONS

TASK_DIR = Path(__file__).resolve().parents[1] / "sample_data" / "eval_tasks"

# The launcher's names (NeMo's) for the zero-shot benchmarks, and lm-eval's names for them.
# They need their datasets from the Hugging Face hub, or already in its cache.
STANDARD_TASKS = {
    "lambada": "lambada_openai",
    "boolq": "boolq",
    "race": "race",
    "piqa": "piqa",
    "hellaswag": "hellaswag",
    "winogrande": "winogrande",
    "wikitext2": "wikitext",
    "wikitext103": "wikitext103",  # ours, in TASK_DIR: lm-eval ships WikiText-2 only
}
# Shipped with the launcher (TASK_DIR): small, and run with no network.
OFFLINE_TASKS = ("tiny_lambada", "tiny_choice", "tiny_wikitext", "tiny_generate")
GROUPS = {"all_tasks": tuple(STANDARD_TASKS), "offline_tasks": OFFLINE_TASKS}
TASKS_KEY = "evaluation.run.tasks"
INCLUDE_KEY = "evaluation.run.include_path"

# `harness`: lm-evaluation-harness tasks (jobs/evaluation/evaluate.py); `fine_tuned`: a tuned
# model's answers scored by exact match and F1 (jobs/fine_tuning/evaluate_tuned.py).
KINDS = ("harness", "fine_tuned")


def requested_names(value: Any, key: str = TASKS_KEY) -> list[str]:
    """`tasks` as given: a comma-separated string or a list, in order, each name once."""
    if isinstance(value, ListConfig | list | tuple):
        parts = [str(item) for item in value]
    elif isinstance(value, str):
        parts = value.split(",")
    else:
        raise ConfigError(key, f"{value!r} is not a task name or list", "Give e.g. lambada,piqa")
    names = list(dict.fromkeys(part.strip() for part in parts if part.strip()))
    if not names:
        raise ConfigError(key, "names no task", "Give e.g. offline_tasks or all_tasks")
    return names


def include_paths(value: Any, key: str = INCLUDE_KEY) -> list[Path]:
    """The user's task folders: one, a comma-separated string of them, or a list."""
    if value in (None, ""):
        return []
    items = list(value) if isinstance(value, ListConfig | list | tuple) else str(value).split(",")
    paths = []
    for index, item in enumerate(items):
        path = Path(str(item).strip())
        name = key if len(items) == 1 else f"{key}[{index}]"
        if not path.is_dir():
            problem = "is not a folder" if path.exists() else "does not exist"
            raise ConfigError(name, f"{path} {problem}", "Give a folder of lm-eval task YAMLs")
        paths.append(path)
    return paths


def user_task_names(paths: Iterable[Path]) -> set[str]:
    """Task and group names the YAML files under `paths` define. Read as plain YAML with every
    tag ignored (`!function` is lm-eval's), since only the names matter here."""
    names: set[str] = set()
    for path in paths:
        for file in sorted(path.rglob("*.yaml")):
            try:
                loaded = yaml.load(file.read_text(encoding="utf-8"), Loader=_AnyTagLoader)
            except (OSError, UnicodeDecodeError, yaml.YAMLError):
                continue  # lm-eval reports a broken file when it loads it
            if isinstance(loaded, dict):
                for field in ("task", "group"):
                    if isinstance(loaded.get(field), str):
                        names.add(loaded[field])
    return names


class _AnyTagLoader(yaml.SafeLoader):
    pass


_AnyTagLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def lm_eval_tasks(names: list[str], user_names: set[str], key: str = TASKS_KEY) -> list[str]:
    """The lm-eval task names to run, groups expanded, in the order given. An unknown name is a
    ConfigError that lists every name this recipe accepts."""
    tasks: list[str] = []
    for name in names:
        if name in GROUPS:
            members = [STANDARD_TASKS.get(member, member) for member in GROUPS[name]]
        elif name in STANDARD_TASKS:
            members = [STANDARD_TASKS[name]]
        elif name in OFFLINE_TASKS or name in user_names:
            members = [name]
        else:
            choices = [*GROUPS, *STANDARD_TASKS, *OFFLINE_TASKS, *sorted(user_names)]
            raise ConfigError(
                key,
                f"{name!r} is not a task",
                f"Use a comma-separated list of: {', '.join(choices)} (tasks of your own: "
                f"set {INCLUDE_KEY} to their folder)",
            )
        tasks += [member for member in members if member not in tasks]
    return tasks


def launcher_name(task: str) -> str:
    """The recipe's name for an lm-eval task name (for messages)."""
    return next((ours for ours, theirs in STANDARD_TASKS.items() if theirs == task), task)


def needs_hub(task: str) -> bool:
    return task in STANDARD_TASKS.values()


CONVERTED_FILE = "converted/model.nemo"  # in run.results_dir


def evaluates_checkpoint(model: Any) -> bool:
    """Whether model.checkpoint_folder names a training checkpoint to evaluate (NeMo's way)."""
    return model.get("checkpoint_folder") not in (None, "")


def evaluated_file(cfg: Any) -> Path:
    """The portable file the harness evaluates: model.nemo_model, or, when
    model.checkpoint_folder names a training checkpoint, the file the stage's own conversion
    job writes from it into run.results_dir."""
    if evaluates_checkpoint(cfg.model):
        return Path(str(cfg.run.results_dir)) / CONVERTED_FILE
    return Path(str(cfg.model.nemo_model))


def portable_model_config(path: Path, key: str = "evaluation.model.nemo_model") -> DictConfig:
    """The model section a portable file records, checked (portable_check) without loading
    its weights."""
    return require_portable(path, key)


def check_precision(requested: Any, recorded: Any, key: str = "evaluation.model.precision") -> None:
    """null means as trained; a value must name the precision the model was trained in (the
    file holds weights of that precision, and evaluation runs them as they are)."""
    if requested is None:
        return
    if str(requested) not in PRECISIONS:
        raise ConfigError(
            key, f"{requested!r} is not a precision", f"Use null or one of: {', '.join(PRECISIONS)}"
        )
    trained = PRECISIONS.get(str(recorded), str(recorded))
    if PRECISIONS[str(requested)] != trained:
        raise ConfigError(
            key,
            f"{requested} differs from the model's training precision ({recorded})",
            "Set it to null (as trained)",
        )
