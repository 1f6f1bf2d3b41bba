"""The `clean` step: Unicode repair (ftfy), whitespace normalisation, boilerplate lines."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from launcher_scripts.curation.document import Document
from launcher_scripts.curation.step import CurationStep, DocumentStep, Exists, register
from launcher_scripts.errors import ConfigError

_SPACES = re.compile(r"[ \t\u00a0\u2000-\u200b\u3000]+")
_BLANK_RUNS = re.compile(r"\n{3,}")


def _check(section: Any, key: str, exists: Exists) -> None:
    for name in ("fix_unicode", "normalize_whitespace"):
        if not isinstance(section.get(name), bool):
            raise ConfigError(f"{key}.{name}", "is not true or false", "Set true or false")
    for index, pattern in enumerate(section.get("remove_lines") or ()):
        try:
            re.compile(str(pattern))
        except re.error as error:
            raise ConfigError(
                f"{key}.remove_lines[{index}]",
                f"{pattern!r} is not a regular expression ({error})",
                "Fix the pattern (Python re syntax)",
            ) from None


class Cleaner:
    def __init__(self, section: Any) -> None:
        self.fix_unicode = bool(section.fix_unicode)
        self.normalize_whitespace = bool(section.normalize_whitespace)
        patterns = [str(p) for p in section.get("remove_lines") or ()]
        self.boilerplate = re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None
        if self.fix_unicode:
            import ftfy

            self._fix = ftfy.fix_text

    def __call__(self, doc: Document) -> str | None:
        text = doc.text
        if self.fix_unicode:
            text = self._fix(text)
        if self.boilerplate is not None:
            text = "\n".join(line for line in text.split("\n") if not self.boilerplate.search(line))
        if self.normalize_whitespace:
            lines = (_SPACES.sub(" ", line).strip() for line in text.split("\n"))
            text = _BLANK_RUNS.sub("\n\n", "\n".join(lines)).strip()
        doc.text = text
        return None if text.strip() else "empty_after_cleaning"


def _build(section: Any, work: Path) -> DocumentStep:
    return Cleaner(section)


register(
    CurationStep(
        name="clean",
        summary="Unicode repair (ftfy), whitespace normalisation and boilerplate lines removed",
        check=_check,
        inputs=lambda section: (),
        prepare=None,
        build=_build,
    )
)
