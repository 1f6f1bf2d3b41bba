"""data_curation's sources on files the tests build: WARC pages, a Wikipedia dump and arXiv
sources extract to the expected text; damaged files are read up to the damage and counted."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launcher_scripts.curation.sources import ReadStats, sources
from tests.support.commands import assert_one_line_error, run_main
from tests.support.curation import curate_overrides, output_records
from tests.support.curation_sources import (
    damaged_warc,
    write_arxiv_bulk,
    write_warc,
    write_wikipedia_dump,
)
from tests.support.http_site import Site


def read_all(kind: str, path: Path) -> tuple[list, ReadStats]:
    stats = ReadStats()
    docs = list(sources()[kind].read(str(path), OmegaConf.create({}), stats))
    return docs, stats


def test_warc_pages_give_their_main_text_in_their_declared_encoding(tmp_path: Path) -> None:
    expected = write_warc(tmp_path / "crawl.warc.gz")
    docs, stats = read_all("common_crawl", tmp_path / "crawl.warc.gz")
    by_url = {doc.meta["url"]: doc for doc in docs}
    assert set(by_url) == {*expected, "http://a.example/empty"}  # HTML responses only
    for url, words in expected.items():
        assert words in by_url[url].text
        assert "Home" not in by_url[url].text and "Contact us" not in by_url[url].text
    assert by_url["http://a.example/empty"].text.strip() == ""
    assert by_url["http://a.example/harbor"].id.startswith("<urn:uuid:")
    assert stats.records == 3 and not stats.bad


def test_a_corrupt_warc_record_ends_the_file_counted(tmp_path: Path) -> None:
    write_warc(tmp_path / "crawl.warc.gz")
    damaged = damaged_warc(tmp_path / "crawl.warc.gz", tmp_path / "damaged.warc.gz")
    docs, stats = read_all("common_crawl", damaged)
    assert [doc.meta["url"] for doc in docs] == ["http://a.example/harbor"]
    assert set(stats.bad) == {"corrupt_warc_record"}
    assert "damaged.warc.gz after record 1" in stats.examples["corrupt_warc_record"][0]


def test_wikipedia_articles_become_plain_text(tmp_path: Path) -> None:
    expected = write_wikipedia_dump(tmp_path / "wiki.xml.bz2")
    docs, stats = read_all("wikipedia", tmp_path / "wiki.xml.bz2")
    assert {doc.meta["title"] for doc in docs} == set(expected)  # no talk page, no redirect
    for doc in docs:
        assert expected[doc.meta["title"]] in doc.text
        for markup in ("[[", "{{", "<ref", "Category:", "thumb", "'''"):
            assert markup not in doc.text, doc.text
    harbor = next(doc for doc in docs if doc.meta["title"] == "Harbor")
    assert "\nHistory\n" in harbor.text and harbor.id == "wiki.xml.bz2:1"
    assert stats.records == 2 and not stats.bad


def test_a_truncated_wikipedia_dump_is_read_to_the_break(tmp_path: Path) -> None:
    write_wikipedia_dump(tmp_path / "wiki.xml.bz2")
    data = (tmp_path / "wiki.xml.bz2").read_bytes()
    (tmp_path / "cut.xml.bz2").write_bytes(data[: len(data) * 2 // 3])
    _docs, stats = read_all("wikipedia", tmp_path / "cut.xml.bz2")
    assert set(stats.bad) == {"truncated_or_corrupt_dump"}


def test_arxiv_papers_become_their_text_without_latex_furniture(tmp_path: Path) -> None:
    expected = write_arxiv_bulk(tmp_path / "arXiv_src_2301_001.tar", corrupt_member=True)
    docs, stats = read_all("arxiv", tmp_path / "arXiv_src_2301_001.tar")
    by_id = {doc.id: doc.text for doc in docs}
    assert set(by_id) == set(expected)
    for paper, pieces in expected.items():
        for piece in pieces:
            assert piece in by_id[paper], (piece, by_id[paper])
    first = by_id["arxiv:2301.00001"]
    for gone in ("comment", "\\cite", "\\label", "plot.pdf", "Smith", "\\documentclass", "\\begin"):
        assert gone not in first, (gone, first)
    assert stats.records == 3 and set(stats.bad) == {"corrupt_paper"}


def test_a_common_crawl_curation_runs_end_to_end(tmp_path: Path) -> None:
    raw = tmp_path / "warc"
    raw.mkdir()
    write_warc(raw / "a.warc.gz")
    shutil.copy(raw / "a.warc.gz", raw / "b.warc.gz")  # the same pages twice: duplicates
    result = run_main(
        *curate_overrides(tmp_path, [raw], "data_curation.steps=[clean]", "data_curation.tasks=2"),
        "data_curation=common_crawl",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = output_records(tmp_path / "curated")
    assert sorted(r["url"] for r in records) == ["http://a.example/harbor", "http://b.example/cafe"]
    report = json.loads(
        (tmp_path / "results" / "curate_common_crawl" / "curation_report.json").read_text()
    )
    assert report["removed"] == {"source: no_text": 2}
    assert report["dedup"]["removed"] == 2


def test_listed_warc_files_are_downloaded_resumably_then_curated(
    site: Site, tmp_path: Path
) -> None:
    write_warc(tmp_path / "a.warc.gz")
    data = (tmp_path / "a.warc.gz").read_bytes()
    site.behaviour.files = {
        "crawl/a.warc.gz": data,
        "crawl/b.warc.gz": data,
        "warc.paths.gz": gzip.compress(b"crawl/a.warc.gz\ncrawl/b.warc.gz\ncrawl/c.warc.gz\n"),
    }
    site.behaviour.cut_after["crawl/a.warc.gz"] = 200  # the first answer breaks off
    folder = tmp_path / "data" / "warc"
    result = run_main(
        *curate_overrides(
            tmp_path, [folder], "data_curation.steps=[clean]", "data_curation.tasks=2"
        ),
        "data_curation=common_crawl",
        f"data_curation.source.download.url_list={site.url}/warc.paths.gz",
        f"data_curation.source.download.list_base={site.url}",
        "data_curation.source.download.limit=2",
        f"data_curation.source.download.dir={folder}",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == [
        "a.warc.gz",
        "b.warc.gz",
    ]
    assert (folder / "a.warc.gz").read_bytes() == data
    assert site.behaviour.gets("crawl/a.warc.gz")[-1] == "bytes=200-"  # resumed
    assert not site.behaviour.gets("crawl/c.warc.gz")  # beyond the limit
    assert len(output_records(tmp_path / "curated")) == 2  # one of each page, duplicates gone


def test_a_download_folder_the_source_does_not_read_is_refused(tmp_path: Path) -> None:
    result = run_main(
        "stages=[data_curation]",
        "data_curation=common_crawl",
        f"base_results_dir={tmp_path}/results",
        "data_curation.source.download.url_list=https://data.commoncrawl.org/x/warc.paths.gz",
        f"data_curation.source.download.dir={tmp_path}/elsewhere",
    )
    assert_one_line_error(result, "data_curation.source.files", "does not read", "download.dir")


def test_a_download_list_naming_two_files_the_same_is_refused_whichever_task_reads_it() -> None:
    from launcher_scripts.jobs.data_prep.download import plan_list

    listed = ["crawl/1/a.warc.gz", "crawl/2/b.warc.gz", "crawl/3/a.warc.gz"]
    for rank in (0, 1):  # neither task's own share holds both a.warc.gz
        with pytest.raises(ValueError, match="names two files the same"):
            plan_list(listed, "https://h", Path("/o"), None, rank, 3)
    pairs = plan_list(listed[:2], "https://h/", Path("/o"), None, 1, 2)
    assert pairs == [("https://h/crawl/2/b.warc.gz", Path("/o/b.warc.gz"))]
