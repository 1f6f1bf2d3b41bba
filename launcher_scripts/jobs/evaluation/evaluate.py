"""The evaluation job: lm-evaluation-harness tasks on a portable model file, at any TP/PP.

    python -m launcher_scripts.jobs.evaluation.evaluate --config <results_dir>/<name>_hydra.yaml

Started as TP x PP processes (torchrun, srun, or one process alone). Every rank runs the same
lm-eval loop (see lm_adapter); only global rank 0 writes into run.results_dir:
    results.json          lm-eval's results (metrics, configs, versions)
    results.md            a table: task, metric, value, stderr
    samples_<task>.jsonl  every request of a task with the model's answers (log-likelihoods,
                          greedy flags, generated text)
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from launcher_scripts.errors import ConfigError
from launcher_scripts.families import family_of
from launcher_scripts.jobs.config_job import run_config_job
from launcher_scripts.jobs.evaluation import report
from launcher_scripts.recipes import evaluation as recipe

LAUNCHER_ROOT = Path(__file__).resolve().parents[3]

OFFLINE_SWITCHES = ("TRANSFORMERS_OFFLINE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
HUB_TIMEOUT_SECONDS = "10"


class EvaluationError(Exception):
    """Bad inputs or unreachable data: printed as one line."""


def configure_hub(environ: dict[str, str] | Any = os.environ) -> bool:
    """Whether the Hugging Face hub is off limits. Any of the usual offline switches turns off
    datasets' and the hub client's network use as a whole, so a missing dataset fails at once
    instead of after retries; online, requests time out after a few seconds, not minutes.
    Must run before `datasets` or `huggingface_hub` is imported: they read these once."""
    offline = any(
        str(environ.get(name, "")).lower() in ("1", "true", "yes", "on")
        for name in OFFLINE_SWITCHES
    )
    if offline:
        environ["HF_HUB_OFFLINE"] = "1"
        environ["HF_DATASETS_OFFLINE"] = "1"
    environ.setdefault("HF_HUB_ETAG_TIMEOUT", HUB_TIMEOUT_SECONDS)
    environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", HUB_TIMEOUT_SECONDS)
    # lm-eval bootstraps stderrs in a multiprocessing pool; forking a process that holds a
    # torch.distributed group and its threads is unsafe, so it bootstraps in this process.
    environ.setdefault("DISABLE_MULTIPROC", "1")
    return offline


def load_tasks(manager: Any, names: list[str], offline: bool) -> list[Any]:
    """Each task built (its dataset loaded) on its own, so a failure names the task."""
    tasks = []
    for name in names:
        try:
            tasks += list(manager.load([name])["tasks"].values())
        except OSError as error:  # datasets' ConnectionError, a dataset missing from the cache
            where = "the Hugging Face cache (offline mode is on)" if offline else "the network"
            raise EvaluationError(
                f"task {recipe.launcher_name(name)} ({name}): its dataset is not available from "
                f"{where}: {_first_line(error)}. Use the offline tasks "
                f"({recipe.TASKS_KEY}=offline_tasks), or pre-cache the dataset (run the job once "
                "where the hub is reachable, with the same HF_HOME)"
            ) from None
        except Exception as error:  # noqa: BLE001 - a task file of the user's can fail any way
            raise EvaluationError(
                f"task {name} cannot be loaded: {type(error).__name__}: {_first_line(error)}"
            ) from None
    return tasks


@contextlib.contextmanager
def _working_directory(path: Path) -> Iterator[None]:
    """contextlib.chdir, which Python 3.10 lacks."""
    previous = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class _QuietCustomDatasets(logging.Filter):
    """lm-eval warns, per task, that a `custom_dataset` task takes extra keywords: true of the
    offline tasks and of no interest to someone reading the job log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


def evaluate(cfg: DictConfig) -> None:
    kind = cfg.get("evaluation_kind", "harness")
    if not family_of(cfg, "evaluation").runs(f"evaluation:{kind}"):
        raise EvaluationError(
            f"evaluation.evaluation_kind: {kind} evaluation has no job program in this launcher "
            "version yet"
        )
    offline = configure_hub()
    run, model = cfg.run, cfg.model
    paths = recipe.include_paths(run.get("include_path"))
    tasks = recipe.lm_eval_tasks(recipe.requested_names(run.tasks), recipe.user_task_names(paths))
    model_file = recipe.evaluated_file(cfg)
    if not model_file.is_file():
        raise EvaluationError(
            f"evaluation.model.nemo_model: {model_file} does not exist: run the conversion "
            "stage first (stages=[conversion,evaluation])"
        )
    recipe.check_precision(
        model.get("precision"), recipe.portable_model_config(model_file).get("precision", 32)
    )
    tensor = int(model.tensor_model_parallel_size)
    pipeline = int(model.pipeline_model_parallel_size)
    batch_size = int(model.eval_batch_size)

    import torch
    import torch.distributed as dist
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    from launcher_scripts.jobs.evaluation.lm_adapter import MegatronLM
    from launcher_scripts.jobs.inference.runner import close_runner, open_runner

    logging.getLogger("lm_eval.api.task").addFilter(_QuietCustomDatasets())
    # lm-eval's own task index takes seconds to build: only when a task may come from it.
    manager = TaskManager(
        include_path=[str(recipe.TASK_DIR), *map(str, paths)],
        include_defaults=bool(paths) or any(recipe.needs_hub(t) for t in tasks),
    )
    # Datasets before the model: an unreachable one fails in seconds, not after the load.
    loaded = load_tasks(manager, tasks, offline)
    on_gpu = str(run.get("accelerator", "gpu")) != "cpu" and torch.cuda.is_available()
    runner = open_runner(model_file, tensor, pipeline, on_gpu=on_gpu)
    try:
        rank = dist.get_rank()
        if rank:
            logging.getLogger("lm_eval").setLevel(logging.WARNING)  # rank 0 tells the story
        # lm-eval records the git revision of the working directory: make that the code that
        # produced the numbers (the launcher's checkout), not the results folder.
        with _working_directory(LAUNCHER_ROOT):
            results = simple_evaluate(
                model=MegatronLM(
                    runner,
                    batch_size,
                    progress=rank == 0,
                    info={
                        "nemo_model": str(model_file),
                        "tensor_model_parallel_size": tensor,
                        "pipeline_model_parallel_size": pipeline,
                    },
                ),
                tasks=loaded,
                batch_size=batch_size,  # recorded in the results' config
                num_fewshot=run.get("num_fewshot"),
                limit=run.get("limit"),
                bootstrap_iters=int(run.get("bootstrap_iters", 1000)),
                log_samples=True,
                task_manager=manager,
            )
        if rank == 0:
            if results is None:
                raise EvaluationError("lm-eval returned no results on rank 0")
            written = report.write(Path(str(run.results_dir)), results)
            print(report.markdown(results), flush=True)
            print(f"wrote {', '.join(str(p) for p in written)}", flush=True)
    finally:
        close_runner()


def _input_errors() -> tuple[type[BaseException], ...]:
    configure_hub()  # before anything imports the hub client
    from launcher_scripts.formats.tokenizer import TokenizerError
    from launcher_scripts.jobs.evaluation.lm_adapter import RequestError
    from launcher_scripts.jobs.inference.runner import InferenceError
    from launcher_scripts.jobs.training.runtime import JobError

    return (EvaluationError, ConfigError, InferenceError, TokenizerError, JobError, RequestError)


def main(argv: list[str] | None = None) -> int:
    return run_config_job(
        argv,
        __doc__.splitlines()[0],
        "evaluation",
        evaluate,
        _input_errors,
        "evaluation:harness",
    )


if __name__ == "__main__":
    sys.exit(main())
