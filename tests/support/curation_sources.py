"""Small source files of each kind data_curation reads, built here with their expected text:
WARC files (warcio's writer), a MediaWiki XML dump, arXiv source tarballs; and damaged ones."""

from __future__ import annotations

import bz2
import gzip
import io
import tarfile
from pathlib import Path

ARTICLE = (
    "The old harbor of the town was rebuilt after the storm of the long winter. "
    "Fishermen and merchants came back to the quays, and the market opened again."
)
SECOND = "A new bridge now crosses the river near the station, and the ferry runs each hour."


def page(title: str, body: str, charset: str = "utf-8") -> bytes:
    return (
        f'<html><head><meta charset="{charset}"><title>{title}</title></head><body>'
        "<nav><a href='/'>Home</a> | <a href='/about'>About</a></nav>"
        f"<article><h1>{title}</h1><p>{body}</p></article>"
        "<footer>Contact us</footer></body></html>"
    ).encode(charset)


def write_warc(path: Path) -> dict[str, str]:
    """A .warc.gz of a UTF-8 page, a windows-1252 page (declared in the HTTP header only), an
    image, a request and a page without text; returns {url: the words its text must hold}."""
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    with path.open("wb") as stream:
        writer = WARCWriter(stream, gzip=True)

        def response(url: str, body: bytes, content_type: str) -> None:
            headers = StatusAndHeaders(
                "200 OK", [("Content-Type", content_type)], protocol="HTTP/1.1"
            )
            record = writer.create_warc_record(
                url, "response", payload=io.BytesIO(body), http_headers=headers
            )
            writer.write_record(record)

        writer.write_record(
            writer.create_warc_record("http://a.example/", "request", payload=io.BytesIO(b"GET /"))
        )
        response(
            "http://a.example/harbor", page("Harbor news", ARTICLE), "text/html; charset=utf-8"
        )
        latin = page(
            "Café réouvert", "Le café près du pont a rouvert après l'hiver.", "windows-1252"
        )
        response(
            "http://b.example/cafe",
            latin.replace(b'charset="windows-1252"', b""),
            "text/html; charset=windows-1252",
        )
        response("http://a.example/logo.png", b"\x89PNG\r\n\x1a\n....", "image/png")
        response(
            "http://a.example/empty", b"<html><body><script>x=1</script></body></html>", "text/html"
        )
    return {
        "http://a.example/harbor": "rebuilt after the storm",
        "http://b.example/cafe": "Le café près du pont a rouvert",
    }


def damaged_warc(source: Path, target: Path) -> Path:
    """`source` with garbage where its third record starts (after two whole gzip members)."""
    data = source.read_bytes()
    members, offset = [], 0
    while offset < len(data):
        members.append(offset)
        decompressor = __import__("zlib").decompressobj(31)
        decompressor.decompress(data[offset:])
        offset = len(data) - len(decompressor.unused_data)
    target.write_bytes(
        data[: members[2]] + b"this is not a WARC record\r\n" * 4 + data[members[2] :]
    )
    return target


def write_wikipedia_dump(path: Path) -> dict[str, str]:
    """A pages-articles dump (bz2) of two articles, a talk page and a redirect; returns
    {title: the text its article must hold}."""
    pages = [
        (
            "Harbor",
            "0",
            "1",
            f"'''Harbor''' is a [[town|small town]].<ref>A source</ref> {ARTICLE}\n"
            "== History ==\nIt was founded long ago. [[File:Harbor.jpg|thumb|The quay]]\n"
            "{{Infobox town|name=Harbor}}\n[[Category:Towns]]",
        ),
        ("Bridge", "0", "2", f"The '''bridge''' is new.\n\n{SECOND}"),
        ("Talk:Harbor", "1", "3", "Discussion of the article."),
        ("Harbour", "0", "4", "#REDIRECT [[Harbor]]"),
    ]
    xml = [
        '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" xml:lang="en">',
        "<siteinfo><sitename>Wikipedia</sitename></siteinfo>",
    ]
    for title, namespace, identifier, text in pages:
        redirect = '<redirect title="Harbor" />' if text.startswith("#REDIRECT") else ""
        escaped = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        xml.append(
            f"<page><title>{title}</title><ns>{namespace}</ns><id>{identifier}</id>{redirect}"
            f'<revision><id>9{identifier}</id><text xml:space="preserve">{escaped}</text>'
            "</revision></page>"
        )
    xml.append("</mediawiki>")
    path.write_bytes(bz2.compress("\n".join(xml).encode("utf-8")))
    return {
        "Harbor": "Harbor is a small town. The old harbor of the town was rebuilt",
        "Bridge": "A new bridge now crosses the river",
    }


MAIN_TEX = r"""\documentclass{article}
\usepackage{amsmath}
\title{On Harbors}
\begin{document}
\maketitle
\begin{abstract}
We study harbors. % a comment that must go
\end{abstract}
\section{Introduction}\label{sec:intro}
Harbors matter \cite{smith}, see Section~\ref{sec:method}.
\input{method}
\begin{figure}[t]\includegraphics{plot.pdf}\caption{A plot}\end{figure}
\begin{thebibliography}{9}\bibitem{smith} Smith. Harbors.\end{thebibliography}
\end{document}
"""
METHOD_TEX = r"""\section{Method}\label{sec:method}
The depth is $d = \sqrt{x^2 + y^2}$ and we call it \emph{safe}.
"""
SINGLE_TEX = r"""\documentclass{article}\begin{document}
\section*{Bridges}
A bridge crosses the river.
\end{document}
"""


def _gzipped_tar(files: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def write_arxiv_bulk(path: Path, corrupt_member: bool = False) -> dict[str, list[str]]:
    """An arXiv bulk source tarball of two papers (a gzipped tar with \\input, a gzipped
    single .tex) and, with `corrupt_member`, a damaged one; returns {id: expected, absent}."""
    members = {
        "2301/2301.00001.gz": _gzipped_tar({"main.tex": MAIN_TEX, "method.tex": METHOD_TEX}),
        "2301/2301.00002.gz": gzip.compress(SINGLE_TEX.encode()),
    }
    if corrupt_member:
        members["2301/2301.00003.gz"] = b"\x1f\x8b\x08\x00garbage-not-deflate"
    with tarfile.open(path, "w") as bulk:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            bulk.addfile(info, io.BytesIO(data))
    return {
        "arxiv:2301.00001": [
            "We study harbors.",
            "Introduction",
            "Harbors matter, see Section.",
            "Method",
            r"$d = \sqrt{x^2 + y^2}$",
            "call it safe",
        ],
        "arxiv:2301.00002": ["Bridges", "A bridge crosses the river."],
    }
