"""The `wikipedia` source: MediaWiki XML dumps (pages-articles, .xml or .xml.bz2), each
article's wikitext made plain text.

The dump is parsed as a stream (one page in memory at a time). Articles only: main namespace
(0), no redirects. mwparserfromhell strips the markup: templates, references, tables, file
and category links go; link text, headings and emphasis stay as text. A truncated or corrupt
dump ends where it breaks, counted.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from launcher_scripts.curation.document import Document
from launcher_scripts.curation.sources import ReadStats, Source, check_files, register
from launcher_scripts.curation.step import Exists

SUFFIXES = (".xml", ".xml.bz2", ".xml.gz")
_DROPPED_LINKS = re.compile(r"^(file|image|category|media):", re.IGNORECASE)
_BLANKS = re.compile(r"\n{3,}")


def _check(section: Any, key: str, exists: Exists) -> None:
    check_files(section, key, exists, SUFFIXES)


def plain_text(wikitext: str) -> str:
    import mwparserfromhell

    code = mwparserfromhell.parse(wikitext)
    for node in list(code.filter_tags(recursive=False)):
        if str(node.tag).lower() in ("ref", "table", "gallery", "math") and code.contains(node):
            code.remove(node)
    for link in list(code.filter_wikilinks()):
        if _DROPPED_LINKS.match(str(link.title).strip()) and code.contains(link):
            code.remove(link)
    text = code.strip_code(normalize=True, collapse=True)
    for heading in code.filter_headings():
        title = heading.title.strip_code().strip()
        text = text.replace(str(heading), title)
    lines = (line.strip() for line in text.split("\n"))
    return _BLANKS.sub("\n\n", "\n".join(lines)).strip()


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def read(path: str, section: Any, stats: ReadStats) -> Iterator[Document]:
    from launcher_scripts.curation.sources.streams import DAMAGE, open_binary

    name = Path(path).name
    title = namespace = identifier = text = None
    redirect = False
    number = 0
    with open_binary(path) as stream:
        events = ElementTree.iterparse(stream, events=("end",))
        while True:
            try:
                _event, element = next(events)
            except StopIteration:
                return
            except (ElementTree.ParseError, *DAMAGE) as error:
                stats.add_bad("truncated_or_corrupt_dump", f"{name} after page {number} ({error})")
                return
            tag = _local(element.tag)
            if tag == "title":
                title = element.text
            elif tag == "ns":
                namespace = element.text
            elif tag == "id" and identifier is None:
                identifier = element.text  # the page's id comes before its revisions'
            elif tag == "redirect":
                redirect = True
            elif tag == "text":
                text = element.text or ""
            elif tag == "page":
                number += 1
                if namespace == "0" and not redirect and text is not None:
                    stats.records += 1
                    yield Document(
                        f"{name}:{identifier}", plain_text(text), {"source": name, "title": title}
                    )
                title = namespace = identifier = text = None
                redirect = False
                element.clear()


register(
    Source(
        name="wikipedia",
        summary="Wikipedia XML dumps: each article's text (mwparserfromhell)",
        suffixes=SUFFIXES,
        check=_check,
        read=read,
    )
)
