"""What the curation pipeline asks of a document step, and the registry that answers.

A step is one module of this package that registers a `CurationStep`: how its recipe section
is checked (one line naming the key), the files it reads, an optional one-off preparation run
once before the document pass (an n-gram index, a trained classifier), and how a job builds
it. Built, it is a callable taking a Document and returning None to keep it or the reason it
is removed (it may change the text and meta in place). Nothing outside this package compares
a step's name: a new step is one module of this package (`steps()` imports them all) and
its recipe keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from launcher_scripts.curation.document import Document
from launcher_scripts.errors import ConfigError


class DocumentStep(Protocol):
    def __call__(self, doc: Document) -> str | None: ...


def require_files(
    key: str,
    names: tuple[str, ...] | list[str],
    exists: Exists,
    suffixes: tuple[str, ...],
    folders: bool = False,
) -> None:
    """Each of `names` (`key[i]`) exists (or will) and ends in one of `suffixes`; with
    `folders`, a folder is taken as it is (its files are listed when the job runs)."""
    for index, name in enumerate(names):
        path = Path(str(name))
        if not exists(path):
            raise ConfigError(f"{key}[{index}]", f"{path} does not exist", "Fix the path")
        if (path.is_file() or not folders) and not path.name.endswith(suffixes):
            raise ConfigError(
                f"{key}[{index}]",
                f"{path.name} is not a file this step or source reads",
                f"Use files ending in {', '.join(suffixes)}",
            )


LANGUAGE = "language"  # the meta key the write step splits the output by


# Whether a path exists or an earlier stage of the run writes it (the stage's view).
Exists = Callable[[Path], bool]


@dataclass(frozen=True)
class CurationStep:
    name: str
    summary: str  # one line for docs and the report
    check: Callable[[Any, str, Exists], None]  # (its recipe section, its key, exists)
    inputs: Callable[[Any], tuple[str, ...]]  # the files it reads
    # (section, work folder) -> None: run once, in its own job, before the document pass; None
    # for a step that needs nothing prepared.
    prepare: Callable[[Any, Path], None] | None
    build: Callable[[Any, Path], DocumentStep]  # (section, work folder) -> the step
    provides: tuple[str, ...] = ()  # the meta keys it sets on a kept document


STEPS: dict[str, CurationStep] = {}


def register(step: CurationStep) -> CurationStep:
    STEPS[step.name] = step
    return step


def steps() -> dict[str, CurationStep]:
    """Every registered step: importing this package's modules registers them."""
    import importlib
    import pkgutil

    import launcher_scripts.curation as package

    for module in pkgutil.iter_modules(package.__path__):
        if not module.ispkg:
            importlib.import_module(f"{package.__name__}.{module.name}")
    return STEPS
