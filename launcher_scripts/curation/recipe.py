"""The data_curation recipe, read and checked once: its source, its document steps in order,
its deduplication, where it works and where it writes. The stage checks it before anything
is submitted; the jobs read the same view from the resolved config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher_scripts.config.checks import require_each_choice, require_int, require_open_fraction
from launcher_scripts.curation.minhash import Banding, banding
from launcher_scripts.curation.sources import Source, input_files, sources
from launcher_scripts.curation.step import LANGUAGE, CurationStep, Exists, steps
from launcher_scripts.errors import ConfigError

# How a candidate pair is checked: `exact` keeps each document's shingle hashes for it (about
# 1.5x the text on disk), `signature` estimates from the MinHash signatures (no extra files;
# pairs within a few hundredths of the threshold land on either side).
VERIFY = ("exact", "signature")


@dataclass(frozen=True)
class FuzzyDedup:
    threshold: float
    ngram: int
    num_hashes: int
    banding: Banding
    seed: int
    verify: str  # exact: the shingle sets' Jaccard; signature: the signatures' agreement


@dataclass(frozen=True)
class Download:
    """Files fetched before the document pass, by data_preparation's download program."""

    url_list: str  # a file or URL of paths or URLs, one per line
    list_base: str
    limit: int | None
    dir: Path


@dataclass(frozen=True)
class CurationRecipe:
    source: Source
    source_section: Any
    download: Download | None
    steps: tuple[tuple[CurationStep, Any], ...]  # in the order they run, with their sections
    tasks: int  # shards of the work; the output depends on this, not on the nodes running it
    exact_dedup: bool
    fuzzy_dedup: FuzzyDedup | None
    partitions: int  # of the dedup's bucket step
    split_by_language: bool
    max_bad_fraction: float
    work_dir: Path
    output_dir: Path

    @property
    def deduplicates(self) -> bool:
        return self.exact_dedup or self.fuzzy_dedup is not None

    def files(self) -> list[str]:
        return input_files(self.source_section)

    @property
    def named_files(self) -> list[Path]:
        """The files and folders the recipe names, as named."""
        return [Path(str(f)) for f in self.source_section.files]

    def files_if_present(self) -> list[str] | None:
        """The input files, or None while a named one does not exist yet (a download or an
        earlier stage writes it)."""
        return self.files() if all(p.exists() for p in self.named_files) else None

    def task_files(self, task: int) -> list[str]:
        """The input files logical task `task` reads: every tasks-th, from its index."""
        return self.files()[task :: self.tasks]

    def prepared_steps(self) -> tuple[tuple[CurationStep, Any], ...]:
        return tuple((step, section) for step, section in self.steps if step.prepare)


def read_curation(cfg: Any, stage: str, exists: Exists = Path.exists) -> CurationRecipe:
    """The recipe of stage section `cfg` (named `stage` in the messages), checked."""
    section = cfg.get("source")
    known = sources()
    kind = section.get("kind") if section is not None else None
    if kind not in known:
        raise ConfigError(
            f"{stage}.source.kind", f"{kind!r} is not a source", f"Use one of: {', '.join(known)}"
        )
    source = known[kind]
    download = _download(section, f"{stage}.source")
    if download is not None:
        folder, checked = download.dir, exists

        def exists(path: Path) -> bool:  # what the download job writes exists by then
            return path == folder or folder in path.parents or checked(path)

    source.check(section, f"{stage}.source", exists)

    registered = steps()
    chosen = cfg.get("steps")
    if chosen is None or isinstance(chosen, str):
        raise ConfigError(
            f"{stage}.steps",
            f"{chosen!r} is not a list",
            f"Give some of [{', '.join(registered)}] or []",
        )
    require_each_choice(f"{stage}.steps", chosen, registered, "a step")
    ordered = []
    for name in chosen:
        if list(chosen).count(name) > 1:
            raise ConfigError(f"{stage}.steps", f"names {name} twice", "Name each step once")
        settings = cfg.get(name)
        if settings is None:
            raise ConfigError(
                f"{stage}.{name}",
                "is missing",
                f"Give the {name} step's section, or drop it from steps",
            )
        registered[name].check(settings, f"{stage}.{name}", exists)
        ordered.append((registered[name], settings))

    tasks = require_int(f"{stage}.tasks", cfg.get("tasks"))
    exact = cfg.get("exact_dedup")
    if not isinstance(exact, bool):
        raise ConfigError(
            f"{stage}.exact_dedup", f"{exact!r} is not true or false", "Set true or false"
        )
    fuzzy = _fuzzy(cfg.get("fuzzy_dedup"), f"{stage}.fuzzy_dedup")
    split = cfg.get("split_by_language")
    if not isinstance(split, bool):
        raise ConfigError(
            f"{stage}.split_by_language", f"{split!r} is not true or false", "Set true or false"
        )
    if split and not any(LANGUAGE in step.provides for step, _ in ordered):
        identifiers = [name for name, step in registered.items() if LANGUAGE in step.provides]
        raise ConfigError(
            f"{stage}.split_by_language",
            "is true but no step identifies the language",
            f"Add {' or '.join(identifiers)} to steps, or set split_by_language=false",
        )
    bad = cfg.get("max_bad_fraction")
    if isinstance(bad, bool) or not isinstance(bad, int | float) or not 0 <= bad <= 1:
        raise ConfigError(
            f"{stage}.max_bad_fraction", f"{bad!r} is not between 0 and 1", "Give e.g. 0.01"
        )
    work_dir, output_dir = Path(str(cfg.work_dir)), Path(str(cfg.output_dir))
    if output_dir == work_dir or work_dir in output_dir.parents or output_dir in work_dir.parents:
        raise ConfigError(
            f"{stage}.output_dir",
            f"{output_dir} and work_dir {work_dir} overlap",
            "Give them separate folders (data_preparation reads every file in output_dir)",
        )
    return CurationRecipe(
        source=source,
        source_section=section,
        download=download,
        steps=tuple(ordered),
        tasks=tasks,
        exact_dedup=exact,
        fuzzy_dedup=fuzzy,
        partitions=require_int(f"{stage}.dedup_partitions", cfg.get("dedup_partitions")),
        split_by_language=split,
        max_bad_fraction=float(bad),
        work_dir=work_dir,
        output_dir=output_dir,
    )


def _fuzzy(section: Any, key: str) -> FuzzyDedup | None:
    if section is None or not section.get("enabled"):
        return None
    threshold = require_open_fraction(f"{key}.threshold", section.get("threshold"))
    ngram = require_int(f"{key}.ngram", section.get("ngram"))
    num_hashes = require_int(f"{key}.num_hashes", section.get("num_hashes"), minimum=8)
    bands, rows = section.get("bands"), section.get("rows")
    if bands is None and rows is None:
        chosen = banding(threshold, num_hashes)
    else:
        chosen = Banding(require_int(f"{key}.bands", bands), require_int(f"{key}.rows", rows))
        if chosen.bands * chosen.rows > num_hashes:
            raise ConfigError(
                f"{key}.bands",
                f"{chosen.bands} bands x {chosen.rows} rows exceed num_hashes={num_hashes}",
                "Lower them, or set both null to choose them from the threshold",
            )
    seed = section.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"{key}.seed", f"{seed!r} is not an integer", "Give e.g. 1")
    verify = section.get("verify")
    if verify not in VERIFY:
        raise ConfigError(
            f"{key}.verify", f"{verify!r} is not valid", f"Use one of: {', '.join(VERIFY)}"
        )
    return FuzzyDedup(threshold, ngram, num_hashes, chosen, seed, str(verify))


def _download(source: Any, key: str) -> Download | None:
    section = source.get("download")
    if section is None or section.get("url_list") is None:
        return None
    limit = section.get("limit")
    if limit is not None:
        require_int(f"{key}.download.limit", limit)
    folder = Path(str(section.get("dir")))
    files = [Path(str(f)) for f in source.get("files") or ()]
    if not any(f == folder or folder in f.parents for f in files):
        raise ConfigError(
            f"{key}.files",
            f"does not read {folder}, where download.dir saves the files",
            f"Add {folder} to {key}.files",
        )
    return Download(str(section.url_list), str(section.get("list_base") or ""), limit, folder)
