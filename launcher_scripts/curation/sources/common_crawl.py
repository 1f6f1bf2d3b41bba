"""The `common_crawl` source: WARC files (.warc or .warc.gz, as Common Crawl publishes them),
each HTML response record's main text extracted.

warcio reads the records; resiliparse's HTML-to-text extractor (C++, main content only:
navigation, headers and footers left out) turns a page into text. A page is decoded with the
charset its HTTP header declares, else as UTF-8, else with the encoding resiliparse detects.
A record that cannot be read ends the file where it is (WARC records are not resynchronised),
counted. A page without text is removed as such by the document pass.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from launcher_scripts.curation.document import Document
from launcher_scripts.curation.sources import ReadStats, Source, check_files, register
from launcher_scripts.curation.step import Exists

SUFFIXES = (".warc", ".warc.gz")
_CHARSET = re.compile(r"charset=[\"']?([\w.:-]+)", re.IGNORECASE)


def _check(section: Any, key: str, exists: Exists) -> None:
    check_files(section, key, exists, SUFFIXES)


def decode_page(body: bytes, content_type: str) -> str:
    declared = _CHARSET.search(content_type or "")
    if declared:
        try:
            return body.decode(codecs.lookup(declared.group(1)).name)
        except (LookupError, UnicodeDecodeError):
            pass
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        from resiliparse.parse.encoding import bytes_to_str, detect_encoding

        return bytes_to_str(body, detect_encoding(body))


def read(path: str, section: Any, stats: ReadStats) -> Iterator[Document]:
    from resiliparse.extract.html2text import extract_plain_text
    from warcio.archiveiterator import ArchiveIterator
    from warcio.exceptions import ArchiveLoadFailed

    from launcher_scripts.curation.sources.streams import DAMAGE

    name = Path(path).name
    number = 0
    with open(path, "rb") as stream:
        records = iter(ArchiveIterator(stream))
        while True:
            try:
                record = next(records)
                if record.rec_type != "response":
                    continue
                http = record.http_headers
                content_type = http.get_header("Content-Type") if http else ""
                if "html" not in (content_type or "").lower():
                    continue
                number += 1
                stats.records += 1
                body = record.content_stream().read()
            except StopIteration:
                return
            except (ArchiveLoadFailed, ValueError, *DAMAGE) as error:
                stats.add_bad("corrupt_warc_record", f"{name} after record {number} ({error})")
                return
            headers = record.rec_headers
            where = headers.get_header("WARC-Record-ID") or f"{name}:{number}"
            text = extract_plain_text(decode_page(body, content_type), main_content=True)
            meta = {
                "source": name,
                "url": headers.get_header("WARC-Target-URI"),
                "date": headers.get_header("WARC-Date"),
            }
            yield Document(where, text, meta)


register(
    Source(
        name="common_crawl",
        summary="Common Crawl WARC files: each HTML page's main text (warcio, resiliparse)",
        suffixes=SUFFIXES,
        check=_check,
        read=read,
    )
)
