"""The last pass of data_curation: each task's kept documents, less the duplicates the
components step removed, written as JSONL shards data_preparation reads.

    python3 -m launcher_scripts.jobs.curation.write --config STAGE.yaml [--workers N]

Output: output_dir/part_<task>.jsonl, or output_dir/<language>/part_<task>.jsonl with
split_by_language; each file is written under a hidden name and renamed when complete, and
work_dir/written/<task>.json (documents and bytes written, duplicates removed with examples)
marks the task done.
"""

from __future__ import annotations

import io
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import IO

import numpy as np
import zstandard

from launcher_scripts.curation.step import LANGUAGE
from launcher_scripts.jobs.curation.work import Work, load_recipe, run_units, write_json

EXAMPLES = 3
EXAMPLE_CHARS = 300


def shard_name(task: int) -> str:
    return f"part_{task:05d}.jsonl"


def write_task(config: str, task: int) -> str:
    _cfg, recipe = load_recipe(config)
    work = Work(recipe.work_dir)
    removed = np.load(work.removed(task)) if recipe.deduplicates else np.zeros(0, dtype=np.uint32)
    drop = set(removed.tolist())
    name = shard_name(task)
    for stale in recipe.output_dir.rglob(f".{name}.*"):  # a killed earlier attempt's
        stale.unlink()
    outputs: dict[str, tuple[Path, IO[bytes]]] = {}
    documents: Counter[str] = Counter()
    written_bytes = duplicates = 0
    examples: list[dict[str, str]] = []
    try:
        with work.kept(task).open("rb") as raw:
            # Bytes in, bytes out: a line is parsed only for an example or its language.
            lines = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))
            for index, line in enumerate(lines):
                if index in drop:
                    duplicates += 1
                    if len(examples) < EXAMPLES:
                        record = json.loads(line)
                        examples.append(
                            {"id": str(record["id"]), "text": record["text"][:EXAMPLE_CHARS]}
                        )
                    continue
                language = ""
                if recipe.split_by_language:
                    language = str(json.loads(line).get(LANGUAGE, "unknown"))
                if language not in outputs:
                    folder = recipe.output_dir / language if language else recipe.output_dir
                    folder.mkdir(parents=True, exist_ok=True)
                    temporary = folder / f".{name}.{os.getpid()}.tmp"
                    outputs[language] = (temporary, temporary.open("wb"))
                outputs[language][1].write(line)
                documents[language] += 1
                written_bytes += len(line)
    finally:
        for _temporary, stream in outputs.values():
            stream.close()
    for temporary, _stream in outputs.values():
        os.replace(temporary, temporary.with_name(name))
    write_json(
        work.written(task),
        {
            "documents": sum(documents.values()),
            "by_language": {k or "all": v for k, v in documents.items()},
            "bytes": written_bytes,
            "duplicates_removed": duplicates,
            "duplicate_examples": examples,
        },
    )
    total = sum(documents.values())
    return f"write task {task}: {total:,} documents, {duplicates:,} duplicates removed"


def main(argv: list[str] | None = None) -> int:
    return run_units(
        argv,
        "data_curation's output: the kept documents less the duplicates, as JSONL shards",
        lambda recipe: recipe.tasks,
        lambda work, task: work.written(task),
        write_task,
    )


if __name__ == "__main__":
    sys.exit(main())
