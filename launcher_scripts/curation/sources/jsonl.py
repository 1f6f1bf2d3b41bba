"""The `jsonl` source: the user's JSON-lines files (optionally .gz, .bz2 or .zst), one
document per line. A line that is not JSON, or lacks the text key, is counted and skipped; a
truncated compressed file is read up to the damage and counted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from launcher_scripts.curation.document import Document
from launcher_scripts.curation.sources import ReadStats, Source, check_files, register
from launcher_scripts.curation.sources.streams import open_text
from launcher_scripts.curation.step import Exists

SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.bz2", ".jsonl.zst")


def _check(section: Any, key: str, exists: Exists) -> None:
    check_files(section, key, exists, SUFFIXES)


def read(path: str, section: Any, stats: ReadStats) -> Iterator[Document]:
    text_key = str(section.get("text_key") or "text")
    id_key = section.get("id_key")
    stem = Path(path).name
    with open_text(path, stats) as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            stats.records += 1
            where = f"{stem}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                stats.add_bad("not_json", where)
                continue
            text = record.get(text_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                stats.add_bad(f"no_text_key_{text_key}", where)
                continue
            doc_id = str(record[id_key]) if id_key and id_key in record else where
            meta = {k: v for k, v in record.items() if k not in (text_key, id_key, "id")}
            yield Document(doc_id, text, {"source": stem, **meta})


register(
    Source(
        name="jsonl",
        summary="your JSON-lines files, one document per line",
        suffixes=SUFFIXES,
        check=_check,
        read=read,
    )
)
