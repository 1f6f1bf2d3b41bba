"""The dataset loader of the offline tasks (lm-eval's `custom_dataset` hook).

lm-eval's own `dataset_path: json` resolves relative `data_files` against the working
directory, so shipped task files would only work from one folder. This loader resolves them
against the shipped task folder instead, wherever the package is installed, and builds the
dataset in memory (nothing is written to the Hugging Face cache).

A task of your own may use it too, with absolute paths:

    custom_dataset: !function launcher_scripts.jobs.evaluation.offline_data.load
    dataset_kwargs:
      data_files: {test: /data/my_task.jsonl}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from launcher_scripts.recipes.evaluation import TASK_DIR


def load(data_files: dict[str, str] | str, **_metadata: Any) -> Any:
    """A DatasetDict with one split per entry of `data_files` (a lone path is the test split).
    lm-eval passes the task's metadata as keywords too: they are ignored."""
    import datasets

    files = {"test": data_files} if isinstance(data_files, str) else dict(data_files)
    return datasets.DatasetDict(
        {split: datasets.Dataset.from_list(read_jsonl(path)) for split, path in files.items()}
    )


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    file = Path(path)
    if not file.is_absolute():
        file = TASK_DIR / file
    with file.open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]
