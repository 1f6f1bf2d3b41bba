"""The `decontamination` step: remove documents that contain text of the evaluation and
fine-tuning tasks (the reference's "task data preparation" and "find/remove matching n-grams").

Preparation reads the task files (JSON, JSONL, optionally gzipped, or plain text; every
string field of a record is task text) and the lm-eval tasks named (each evaluation
document's prompt, target and choices, through lm-eval's own task definitions), and writes the
sorted hashes of their word n-grams; a task text shorter than n words is too short to match
reliably and is skipped. A document sharing any n-gram with a task is removed.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from launcher_scripts.config.checks import require_int
from launcher_scripts.curation.document import Document
from launcher_scripts.curation.step import (
    CurationStep,
    DocumentStep,
    Exists,
    register,
    require_files,
)
from launcher_scripts.errors import ConfigError, JobError
from launcher_scripts.files import replaced_file, write_atomic

INDEX = "decontamination/task_ngrams.npy"
TASK_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz", ".txt")


def _files(section: Any) -> tuple[str, ...]:
    return tuple(str(f) for f in section.get("task_files") or ())


def _tasks(section: Any) -> tuple[str, ...]:
    return tuple(str(t) for t in section.get("lm_eval_tasks") or ())


def _check(section: Any, key: str, exists: Exists) -> None:
    require_int(f"{key}.ngram", section.get("ngram"), minimum=3)
    files = _files(section)
    if not files and not _tasks(section):
        raise ConfigError(
            f"{key}.task_files",
            "is empty and so is lm_eval_tasks",
            "Name the task data to remove (the SFT data and evaluation sets as JSONL, or "
            "lm-eval task names in lm_eval_tasks), or drop decontamination from steps",
        )
    include = section.get("lm_eval_include_path")
    if _tasks(section) and include is not None and not exists(Path(str(include))):
        raise ConfigError(
            f"{key}.lm_eval_include_path",
            f"{include} does not exist",
            "Give a folder of task YAMLs",
        )
    require_files(f"{key}.task_files", files, exists, TASK_SUFFIXES)


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def task_texts(path: str) -> Iterator[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as stream:  # type: ignore[operator]
        if path.endswith(".txt"):
            yield stream.read()
            return
        if path.removesuffix(".gz").endswith(".json"):
            yield from _strings(json.load(stream))
            return
        for number, line in enumerate(stream, 1):
            if line.strip():
                try:
                    yield from _strings(json.loads(line))
                except json.JSONDecodeError as error:
                    raise JobError(f"{path}:{number}: not JSON ({error.msg})") from None


def lm_eval_texts(names: tuple[str, ...], include: str | None) -> Iterator[str]:
    """The prompts, targets and choices of each lm-eval task's evaluation documents."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=[include] if include else None, include_defaults=False)
    if any(name not in manager.all_tasks for name in names):  # lm-eval's own: index them too
        manager = TaskManager(include_path=[include] if include else None)
    for name in names:
        if name not in manager.all_tasks:
            raise JobError(
                f"data_curation.decontamination.lm_eval_tasks: {name} is not an lm-eval task "
                "here (lm-eval's own or lm_eval_include_path's)"
            )
        try:
            loaded = manager.load([name])["tasks"]
        except OSError as error:  # a dataset not available offline
            first = (
                str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            )
            raise JobError(
                f"data_curation.decontamination.lm_eval_tasks: {name}'s dataset is not available: "
                f"{first}. Pre-cache it, or give its data in task_files"
            ) from None
        for task in loaded.values():
            for doc in task.eval_docs:
                yield from _strings(task.doc_to_text(doc))
                if task.OUTPUT_TYPE == "multiple_choice":
                    yield from _strings(task.doc_to_choice(doc))
                else:
                    yield from _strings(task.doc_to_target(doc))


def _prepare(section: Any, work: Path) -> None:
    import numpy as np

    from launcher_scripts.curation.shingles import ngram_hashes, words

    n = int(section.ngram)
    parts, texts = [], 0
    include = section.get("lm_eval_include_path")
    sources = [task_texts(path) for path in _files(section)]
    if _tasks(section):
        sources.append(lm_eval_texts(_tasks(section), str(include) if include else None))
    for source in sources:
        for text in source:
            if len(words(text)) >= n:
                parts.append(np.unique(ngram_hashes(text, n)))
                texts += 1
    hashes = np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.uint64)
    target = work / INDEX
    with replaced_file(target) as temporary:
        np.save(temporary, hashes)
    write_atomic(
        target.with_suffix(".json"), json.dumps({"task_texts": texts, "ngrams": len(hashes)})
    )
    print(f"decontamination: {len(hashes):,} {n}-grams from {texts:,} task texts", flush=True)


class Decontaminator:
    def __init__(self, section: Any, work: Path) -> None:
        import numpy as np

        self.n = int(section.ngram)
        self.index = np.load(work / INDEX)

    def __call__(self, doc: Document) -> str | None:
        import numpy as np

        from launcher_scripts.curation.shingles import ngram_hashes

        if len(self.index) == 0:
            return None
        hashes = ngram_hashes(doc.text, self.n)
        if len(hashes) == 0:
            return None
        places = np.searchsorted(self.index, hashes).clip(max=len(self.index) - 1)
        return "contains_task_text" if bool(np.any(self.index[places] == hashes)) else None


def _build(section: Any, work: Path) -> DocumentStep:
    return Decontaminator(section, work)


register(
    CurationStep(
        name="decontamination",
        summary="documents sharing a word n-gram with task data removed",
        check=_check,
        inputs=_files,
        prepare=_prepare,
        build=_build,
    )
)
