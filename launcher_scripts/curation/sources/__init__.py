"""Where documents come from: one registered module per source kind (the user's JSONL,
Common Crawl WARC files, Wikipedia dumps, arXiv sources). A source names its input files and
reads one into Documents, counting the records it cannot read instead of stopping at them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher_scripts.curation.document import Document
from launcher_scripts.curation.step import Exists, require_files
from launcher_scripts.errors import ConfigError


@dataclass
class ReadStats:
    """Records read and those skipped, by reason, with a few examples (file:record)."""

    records: int = 0
    bad: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add_bad(self, reason: str, where: str) -> None:
        self.bad[reason] += 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < 3:
            shown.append(where)


@dataclass(frozen=True)
class Source:
    name: str
    summary: str
    suffixes: tuple[str, ...]  # of the files it reads
    check: Callable[[Any, str, Exists], None]  # (the source section, its key, exists)
    read: Callable[[str, Any, ReadStats], Iterator[Document]]  # (file, section, stats)


SOURCES: dict[str, Source] = {}


def register(source: Source) -> Source:
    SOURCES[source.name] = source
    return source


def sources() -> dict[str, Source]:
    """Every registered source: importing this package's modules registers them."""
    import importlib
    import pkgutil

    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    return SOURCES


def input_files(section: Any) -> list[str]:
    """The files the recipe names (`files`), folders expanded to the files they hold, in
    name order (hidden ones left out)."""
    found: list[str] = []
    for name in section.get("files") or ():
        path = Path(str(name))
        if path.is_dir():
            found += sorted(
                str(p)
                for p in path.rglob("*")
                if p.is_file()
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
        else:
            found.append(str(path))
    return found


def check_files(section: Any, key: str, exists: Exists, suffixes: tuple[str, ...]) -> None:
    names = section.get("files")
    if not names or isinstance(names, str):
        raise ConfigError(
            f"{key}.files", f"{names!r} is not a list of files", "Give [/data/a, /data/b]"
        )
    require_files(f"{key}.files", list(names), exists, suffixes, folders=True)
