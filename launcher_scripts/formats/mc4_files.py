"""The files of mC4 (the allenai/c4 dataset) and the datasets made from them: names only.

Kept free of heavy imports: the data_preparation stage names the same files when it renders
the jobs and checks the configuration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

MULTILINGUAL_NAME = "multilingual/c4-{language}.tfrecord-{index:05d}-of-{count:05d}.json.gz"
CLEANED_ENGLISH_NAME = "en/c4-train.{index:05d}-of-{count:05d}.json.gz"
PARTS_DIR = ".mc4_files"  # per-file datasets, until merged into one per language
TEXT_KEY = "text"


@dataclass(frozen=True)
class Mc4File:
    language: str
    name: str  # path below the URL base and the c4 directory


def plan_files(languages: Sequence[tuple[str, int]], cleaned_english: bool) -> list[Mc4File]:
    """Every file of the languages (name, file count), in language order, then by number.

    With `cleaned_english`, English is the cleaned C4 (en/c4-train...) instead of mC4's.
    """
    files = []
    for language, count in languages:
        cleaned = cleaned_english and language == "en"
        pattern = CLEANED_ENGLISH_NAME if cleaned else MULTILINGUAL_NAME
        for index in range(count):
            files.append(
                Mc4File(language, pattern.format(language=language, index=index, count=count))
            )
    return files


def dataset_prefix(output_dir: Path, language: str) -> Path:
    """Where a language's dataset goes: the name the mT5 training recipes blend."""
    return output_dir / f"mc4_{language}_{TEXT_KEY}_document"


def part_prefix(output_dir: Path, file: Mc4File) -> Path:
    """The per-file dataset the preprocess step makes from `file` (preprocess.py's naming:
    the input's name without .json.gz, then _text_document)."""
    stem = Path(file.name).name.removesuffix(".gz").removesuffix(".json")
    return output_dir / PARTS_DIR / f"{stem}_{TEXT_KEY}_document"
