"""The `arxiv` source: arXiv LaTeX sources, each paper made one text document.

Reads arXiv's bulk source tarballs (.tar, whose members are one gzipped paper each: a tar of
its files or a single .tex), one paper's .tar.gz/.tgz, or a lone .tex. Of a paper, the main
file (the one with \\documentclass) is taken with the files it \\input or \\include, from
\\begin{document} to the bibliography: comments, figures, tables, labels, citations and
references go; section titles become lines; the mathematics stays as written. A paper that
cannot be read is counted and skipped; a bulk tarball that breaks ends where it does.
"""

from __future__ import annotations

import gzip
import io
import re
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from launcher_scripts.curation.document import Document
from launcher_scripts.curation.sources import ReadStats, Source, check_files, register
from launcher_scripts.curation.step import Exists

SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tex")
_COMMENT = re.compile(r"(?<!\\)%.*$", re.MULTILINE)
_INPUT = re.compile(r"\\(?:input|include)\s*\{([^}]+)\}")
_DROPPED_ENVIRONMENTS = re.compile(
    r"\\begin\{(figure|table|tikzpicture|thebibliography)\*?\}.*?\\end\{\1\*?\}", re.DOTALL
)
_SECTION = re.compile(r"\\(?:sub)*(?:section|paragraph|chapter)\*?\s*(?:\[[^\]]*\])?\s*\{([^}]*)\}")
_DROPPED_COMMANDS = re.compile(
    r"\\(?:label|cite[tp]?|citep?|ref|eqref|autoref|cref|Cref|bibliographystyle|"
    r"bibliography|vspace|hspace|includegraphics)\*?\s*(?:\[[^\]]*\])?\s*\{[^}]*\}"
)
_STYLE = re.compile(r"\\(?:emph|textbf|textit|texttt|underline|textsc)\s*\{([^}]*)\}")
_BARE = re.compile(r"\\(?:maketitle|noindent|newpage|clearpage|centering|tableofcontents)\b")
_BLANKS = re.compile(r"\n\s*\n(\s*\n)+")
_SPACE_BEFORE_PUNCTUATION = re.compile(r"[ \t]+([,.;:)])")


def _check(section: Any, key: str, exists: Exists) -> None:
    check_files(section, key, exists, SUFFIXES)


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")  # older LaTeX sources


def paper_text(files: dict[str, str]) -> str:
    """The text of one paper from its .tex files (name -> content); empty without a main file."""
    sources = {name: _COMMENT.sub("", text) for name, text in files.items()}
    main = next((n for n, t in sorted(sources.items()) if "\\documentclass" in t), None)
    if main is None:
        main = next((n for n, t in sorted(sources.items()) if "\\begin{document}" in t), None)
    if main is None:
        return ""

    def inlined(text: str, depth: int) -> str:
        def replace(match: re.Match[str]) -> str:
            name = match.group(1).strip()
            for candidate in (name, f"{name}.tex"):
                found = next(
                    (n for n in sources if n == candidate or n.endswith(f"/{candidate}")), None
                )
                if found is not None and depth < 8:
                    return inlined(sources[found], depth + 1)
            return ""

        return _INPUT.sub(replace, text)

    text = inlined(sources[main], 0)
    start, end = text.find("\\begin{document}"), text.find("\\end{document}")
    text = text[start + len("\\begin{document}") if start >= 0 else 0 : end if end >= 0 else None]
    for marker in ("\\begin{thebibliography}", "\\bibliography{", "\\printbibliography"):
        if marker in text:
            text = text[: text.index(marker)]
    text = _DROPPED_ENVIRONMENTS.sub("", text)
    text = _SECTION.sub(lambda m: f"\n\n{m.group(1).strip()}\n\n", text)
    text = _DROPPED_COMMANDS.sub("", text).replace("~", " ")
    text = _SPACE_BEFORE_PUNCTUATION.sub(r"\1", text)  # where a citation was
    text = _STYLE.sub(r"\1", text)
    text = _BARE.sub("", text)
    text = text.replace("\\begin{abstract}", "").replace("\\end{abstract}", "")
    lines = (line.strip() for line in text.split("\n"))
    return _BLANKS.sub("\n\n", "\n".join(lines)).strip()


def _paper_files(data: bytes) -> dict[str, str]:
    """The .tex files of one gzipped paper: a tar of its files, or a single gzipped .tex."""
    raw = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
    try:
        with tarfile.open(fileobj=io.BytesIO(raw)) as archive:
            return {
                member.name: _decode(archive.extractfile(member).read())  # type: ignore[union-attr]
                for member in archive.getmembers()
                if member.isfile() and member.name.endswith(".tex")
            }
    except tarfile.ReadError:
        return {"main.tex": _decode(raw)}


def read(path: str, section: Any, stats: ReadStats) -> Iterator[Document]:
    from launcher_scripts.curation.sources.streams import DAMAGE

    file = Path(path)
    name = file.name
    if name.endswith(".tex"):
        stats.records += 1
        yield Document(name, paper_text({name: _decode(file.read_bytes())}), {"source": name})
        return
    if name.endswith((".tar.gz", ".tgz")):
        stats.records += 1
        try:
            files = _paper_files(file.read_bytes())
        except (tarfile.TarError, *DAMAGE) as error:
            stats.add_bad("corrupt_paper", f"{name} ({error})")
            return
        yield Document(name, paper_text(files), {"source": name})
        return
    number = 0
    try:
        with tarfile.open(path, "r|") as bulk:  # streamed: one paper in memory at a time
            for member in bulk:
                if not member.isfile() or not member.name.endswith(".gz"):
                    continue
                number += 1
                stats.records += 1
                paper = Path(member.name).name.removesuffix(".gz")
                try:
                    files = _paper_files(bulk.extractfile(member).read())  # type: ignore[union-attr]
                except (tarfile.TarError, *DAMAGE) as error:
                    stats.add_bad("corrupt_paper", f"{name}:{paper} ({error})")
                    continue
                yield Document(f"arxiv:{paper}", paper_text(files), {"source": name})
    except (tarfile.TarError, *DAMAGE) as error:
        stats.add_bad("truncated_or_corrupt_tarball", f"{name} after paper {number} ({error})")


register(
    Source(
        name="arxiv",
        summary="arXiv LaTeX sources: each paper's text from its main .tex file",
        suffixes=SUFFIXES,
        check=_check,
        read=read,
    )
)
