"""Download and extraction jobs of the Pile recipe, against a real HTTP server on 127.0.0.1.

The server answers Range requests like a file server would, and has switches for the
failures the jobs must survive: a connection cut midway, a server that ignores Range, 500s,
a 404, a stalled transfer and announced sizes that do not match the body.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import zstandard

from launcher_scripts.formats.shards import RANK_VARIABLES
from launcher_scripts.jobs.data_prep import download, extract
from launcher_scripts.ports import free_port
from tests.support.http_site import Site

REPO_ROOT = Path(__file__).resolve().parents[1]
# Scheduler variables of the machine running the tests must not pick the rank.
# A timeout no busy machine reaches by accident: no test but the stalled one waits for it.
FAST = download.RetryPolicy(retries=3, wait_s=0.0, timeout_s=30.0)


def payload(size: int, seed: int = 0) -> bytes:
    """Incompressible-looking, position-dependent bytes, so misplaced bytes are caught."""
    return bytes((i * 131 + seed * 7 + (i >> 8)) % 251 for i in range(size))


def run_module(module: str, *args: str, env: dict[str, str] | None = None) -> Any:
    clean = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    clean["PYTHONPATH"] = str(REPO_ROOT)
    clean.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", f"launcher_scripts.jobs.data_prep.{module}", *args],
        check=False,  # the tests assert on the exit status
        cwd=REPO_ROOT,
        env=clean,
        capture_output=True,
        text=True,
        timeout=600,
    )


def run_download(*args: str, env: dict[str, str] | None = None) -> Any:
    return run_module("download", "--retry-wait", "0", "--timeout", "30", *args, env=env)


# --- download: end to end -------------------------------------------------------------------


def test_downloads_this_tasks_share_of_the_shards(site: Site, tmp_path: Path) -> None:
    for n in range(5):
        site.behaviour.files[f"{n:02d}.jsonl.zst"] = payload(3000 + n, seed=n)
    args = ["--url-base", site.url + "/", "--file-numbers", "0-4", "--output-dir", str(tmp_path)]

    result = run_download(*args, "--rank", "1", "--world-size", "2")

    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["01.jsonl.zst", "03.jsonl.zst"]
    assert (tmp_path / "03.jsonl.zst").read_bytes() == payload(3003, seed=3)
    assert "MB/s" in result.stdout


def test_rank_falls_back_to_the_scheduler_environment(site: Site, tmp_path: Path) -> None:
    for n in range(4):
        site.behaviour.files[f"shard-{n}.bin"] = payload(100, seed=n)

    result = run_download(
        "--url-base", site.url, "--file-numbers", "0-3", "--output-dir", str(tmp_path),
        "--name-format", "shard-{}.bin",
        env={"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "3"},
    )  # fmt: skip

    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-0.bin", "shard-3.bin"]


def test_resumes_a_cut_connection_with_a_range_request(site: Site, tmp_path: Path) -> None:
    data = payload(200_000)
    site.behaviour.files["00.jsonl.zst"] = data
    site.behaviour.cut_after["00.jsonl.zst"] = 70_000

    result = run_download(
        "--url-base", site.url, "--file-numbers", "0", "--output-dir", str(tmp_path)
    )

    assert result.returncode == 0, result.stderr
    assert (tmp_path / "00.jsonl.zst").read_bytes() == data
    assert not (tmp_path / "00.jsonl.zst.part").exists()
    assert site.behaviour.gets("00.jsonl.zst") == [None, "bytes=70000-"]


def test_http_404_fails_at_once_naming_the_url(site: Site, tmp_path: Path) -> None:
    result = run_download(
        "--url-base", site.url, "--file-numbers", "7", "--output-dir", str(tmp_path)
    )

    assert result.returncode == 1
    assert f"{site.url}/07.jsonl.zst" in result.stderr
    assert "404" in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert site.behaviour.gets("07.jsonl.zst") == [None]  # no retries
    assert not list(tmp_path.iterdir())


def test_retries_server_errors_until_success(site: Site, tmp_path: Path) -> None:
    site.behaviour.files["00.jsonl.zst"] = payload(5000)
    site.behaviour.fail_500["00.jsonl.zst"] = 2
    args = ["--url-base", site.url, "--file-numbers", "0", "--output-dir", str(tmp_path)]

    result = run_download(*args, "--retries", "2")

    assert result.returncode == 0, result.stderr
    assert (tmp_path / "00.jsonl.zst").read_bytes() == payload(5000)
    assert len(site.behaviour.gets("00.jsonl.zst")) == 3


def test_gives_up_after_the_retries_naming_url_and_last_error(site: Site, tmp_path: Path) -> None:
    site.behaviour.files["00.jsonl.zst"] = payload(5000)
    site.behaviour.fail_500["00.jsonl.zst"] = 10
    args = ["--url-base", site.url, "--file-numbers", "0", "--output-dir", str(tmp_path)]

    result = run_download(*args, "--retries", "2")

    assert result.returncode == 1
    assert f"{site.url}/00.jsonl.zst" in result.stderr
    assert "HTTP 500" in result.stderr
    assert "Traceback" not in result.stderr
    assert len(site.behaviour.gets("00.jsonl.zst")) == 3
    assert not (tmp_path / "00.jsonl.zst").exists()


def test_unreachable_server_is_retried_then_reported(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/vocab.json"

    result = run_download("--file", url, str(tmp_path / "vocab.json"), "--retries", "1")

    assert result.returncode == 1
    assert url in result.stderr
    assert "retry 1/1" in result.stdout
    assert "Traceback" not in result.stderr


def test_size_short_of_the_announced_size_fails(site: Site, tmp_path: Path) -> None:
    site.behaviour.files["00.jsonl.zst"] = payload(4000)
    site.behaviour.size_error = 10  # announces 4010 bytes, sends 4000
    args = ["--url-base", site.url, "--file-numbers", "0", "--output-dir", str(tmp_path)]

    result = run_download(*args, "--retries", "1")

    assert result.returncode == 1
    assert f"{site.url}/00.jsonl.zst" in result.stderr
    assert "4000 of 4010 bytes" in result.stderr
    assert not (tmp_path / "00.jsonl.zst").exists()


def test_single_files_from_urls_and_local_paths(site: Site, tmp_path: Path) -> None:
    site.behaviour.files["gpt2-vocab.json"] = b'{"hello": 0}'
    merges = tmp_path / "source" / "merges.txt"
    merges.parent.mkdir()
    merges.write_bytes(b"#version: 0.2\nh e\n")
    vocab_out = tmp_path / "bpe" / "vocab.json"
    merges_out = tmp_path / "bpe" / "merges.txt"
    copy_out = tmp_path / "bpe" / "merges-from-file-url.txt"

    result = run_download(
        "--file", f"{site.url}/gpt2-vocab.json", str(vocab_out),
        "--file", str(merges), str(merges_out),
        "--file", merges.as_uri(), str(copy_out),
    )  # fmt: skip

    assert result.returncode == 0, result.stderr
    assert vocab_out.read_bytes() == b'{"hello": 0}'
    assert merges_out.read_bytes() == copy_out.read_bytes() == merges.read_bytes()


def test_single_file_from_another_source_is_fetched_again(site: Site, tmp_path: Path) -> None:
    """A tokenizer file (--file) whose URL or local source changed is replaced; the same
    source is kept as it is."""
    site.behaviour.files["a/vocab.txt"] = b"first vocabulary\n"
    site.behaviour.files["b/vocab.txt"] = b"other vocabulary\n"  # the same size
    dest = tmp_path / "bpe" / "vocab.txt"
    assert run_download("--file", f"{site.url}/a/vocab.txt", str(dest)).returncode == 0
    stamp = dest.stat().st_mtime_ns
    kept = run_download("--file", f"{site.url}/a/vocab.txt", str(dest))
    assert kept.returncode == 0 and dest.stat().st_mtime_ns == stamp

    moved = run_download("--file", f"{site.url}/b/vocab.txt", str(dest))

    assert moved.returncode == 0, moved.stderr
    assert "settings changed (source" in moved.stdout and "fetching" in moved.stdout
    assert dest.read_bytes() == b"other vocabulary\n"
    # A local source edited in place (same size): copied again.
    local = tmp_path / "mine.txt"
    local.write_bytes(b"local vocabulary\n")
    assert run_download("--file", str(local), str(dest)).returncode == 0
    local.write_bytes(b"LOCAL VOCABULARY\n")
    os.utime(local, ns=(stamp, stamp))  # another mtime than the first copy had
    edited = run_download("--file", str(local), str(dest))
    assert edited.returncode == 0 and f"input {local} changed" in edited.stdout
    assert dest.read_bytes() == b"LOCAL VOCABULARY\n"
    assert sorted(p.name for p in dest.parent.iterdir()) == ["vocab.txt", "vocab.txt.meta.json"]


def test_missing_local_source_fails(tmp_path: Path) -> None:
    result = run_download("--file", str(tmp_path / "nope.txt"), str(tmp_path / "out.txt"))

    assert result.returncode == 1
    assert "nope.txt" in result.stderr
    assert "Traceback" not in result.stderr


def test_usage_needs_one_mode() -> None:
    assert run_download().returncode == 2
    assert run_download("--url-base", "http://x", "--file-numbers", "0").returncode == 2


# --- download: fine-grained -----------------------------------------------------------------


def test_existing_complete_file_is_skipped_after_a_size_check(site: Site, tmp_path: Path) -> None:
    site.behaviour.files["a.bin"] = payload(1234)
    dest = tmp_path / "a.bin"
    dest.write_bytes(payload(1234))

    download.fetch(f"{site.url}/a.bin", dest, FAST)

    assert [method for method, _, _ in site.behaviour.requests] == ["HEAD"]
    assert dest.read_bytes() == payload(1234)


def test_existing_file_of_the_wrong_size_is_an_error(site: Site, tmp_path: Path) -> None:
    site.behaviour.files["a.bin"] = payload(1234)
    dest = tmp_path / "a.bin"
    dest.write_bytes(b"short")

    with pytest.raises(download.DownloadError, match="exists with 5 bytes .* has 1234"):
        download.fetch(f"{site.url}/a.bin", dest, FAST)
    assert dest.read_bytes() == b"short"  # never deleted behind the user's back


def test_server_ignoring_range_restarts_from_zero(site: Site, tmp_path: Path) -> None:
    data = payload(50_000)
    site.behaviour.files["a.bin"] = data
    site.behaviour.ignore_range = True
    dest = tmp_path / "a.bin"
    download.part_path(dest).write_bytes(data[:20_000])

    download.fetch(f"{site.url}/a.bin", dest, FAST)

    assert dest.read_bytes() == data
    assert site.behaviour.gets("a.bin") == ["bytes=20000-"]


def test_complete_part_answered_416_is_finished(site: Site, tmp_path: Path) -> None:
    data = payload(10_000)
    site.behaviour.files["a.bin"] = data
    dest = tmp_path / "a.bin"
    download.part_path(dest).write_bytes(data)

    download.fetch(f"{site.url}/a.bin", dest, FAST)

    assert dest.read_bytes() == data
    assert not download.part_path(dest).exists()
    assert site.behaviour.gets("a.bin") == ["bytes=10000-"]


def test_part_longer_than_the_file_restarts_from_zero(site: Site, tmp_path: Path) -> None:
    data = payload(10_000)
    site.behaviour.files["a.bin"] = data
    dest = tmp_path / "a.bin"
    download.part_path(dest).write_bytes(payload(12_000, seed=5))

    download.fetch(f"{site.url}/a.bin", dest, FAST)

    assert dest.read_bytes() == data
    assert site.behaviour.gets("a.bin") == ["bytes=12000-", None]


def test_more_bytes_than_the_announced_total_is_a_mismatch(site: Site, tmp_path: Path) -> None:
    site.behaviour.files["a.bin"] = payload(10_000)
    site.behaviour.size_error = -100  # Range total says 9900, the body runs to 10000
    dest = tmp_path / "a.bin"
    download.part_path(dest).write_bytes(payload(10_000)[:4000])

    with pytest.raises(download.DownloadError, match="size mismatch .*10000 bytes.* 9900"):
        download.fetch(f"{site.url}/a.bin", dest, FAST)
    assert not dest.exists()
    assert not download.part_path(dest).exists()


def test_stalled_transfer_times_out_and_resumes(site: Site, tmp_path: Path) -> None:
    data = payload(30_000)
    site.behaviour.files["a.bin"] = data
    site.behaviour.stall_after["a.bin"] = 12_000
    site.behaviour.stall_s = 3600  # until the test ends: only the client's timeout ends it
    dest = tmp_path / "a.bin"

    # Long enough that no busy machine's pause before an answer reaches it by accident.
    download.fetch(f"{site.url}/a.bin", dest, download.RetryPolicy(2, 0.0, timeout_s=3.0))

    assert dest.read_bytes() == data
    assert site.behaviour.gets("a.bin") == [None, "bytes=12000-"]


def test_client_errors_other_than_408_and_429_are_not_retried(site: Site, tmp_path: Path) -> None:
    with pytest.raises(download.DownloadError, match=r"HTTP 404 .*/missing\.bin"):
        download.download(f"{site.url}/missing.bin", tmp_path / "m.bin", FAST)
    assert site.behaviour.gets("missing.bin") == [None]


def test_backoff_doubles_and_is_capped() -> None:
    policy = download.RetryPolicy(retries=10, wait_s=2.0)
    assert [policy.delay(n) for n in (1, 2, 3, 4)] == [2.0, 4.0, 8.0, 16.0]
    assert policy.delay(10) == download.MAX_RETRY_WAIT_S


def test_content_range_parsing() -> None:
    assert download._content_range("bytes 5-9/10") == (5, 9, 10)
    assert download._content_range("bytes */10") == (None, None, 10)
    assert download._content_range("bytes 0-4/*") == (0, 4, None)
    assert download._content_range(None) == (None, None, None)


def test_unsupported_scheme_fails_without_retrying(tmp_path: Path) -> None:
    with pytest.raises(download.DownloadError, match="only http"):
        download.fetch("s3://bucket/00.jsonl.zst", tmp_path / "00.jsonl.zst", FAST)


def test_local_sources() -> None:
    assert download.is_local("/data/vocab.json")
    assert download.is_local("relative/merges.txt")
    assert download.is_local("file:///data/vocab.json")
    assert not download.is_local("https://host/vocab.json")


# --- extraction -----------------------------------------------------------------------------


def jsonl(n_lines: int, seed: int) -> bytes:
    lines = (
        json.dumps({"text": f"document {seed}-{i} " * 5, "meta": {"i": i}}) for i in range(n_lines)
    )
    return "".join(line + "\n" for line in lines).encode()


def write_zst(path: Path, data: bytes, window_log: int | None = None) -> None:
    """Compress as a stream of unknown size, the way long Pile frames come."""
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=window_log or 0)
    with (
        open(path, "wb") as out,
        zstandard.ZstdCompressor(compression_params=params).stream_writer(out) as writer,
    ):
        writer.write(data)


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    downloads = tmp_path / "raw"
    downloads.mkdir()
    for n in range(3):
        write_zst(downloads / f"{n:02d}.jsonl.zst", jsonl(500, seed=n))
    return downloads


def test_extracts_this_tasks_share_and_removes_downloads(shards: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["--input-dir", str(shards), "--file-numbers", "0-2", "--output-dir", str(out)]

    result = run_module("extract", *args, "--rank", "0", "--world-size", "2", "--remove-downloaded")

    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "00.jsonl",
        "00.jsonl.meta.json",
        "02.jsonl",
        "02.jsonl.meta.json",
    ]
    assert (out / "02.jsonl").read_bytes() == jsonl(500, seed=2)
    assert sorted(p.name for p in shards.iterdir()) == ["01.jsonl.zst"]
    # A re-run after the downloads were removed finds its outputs complete.
    again = run_module("extract", *args, "--rank", "0", "--world-size", "2")
    assert again.returncode == 0, again.stderr
    assert "exists; skipping" in again.stdout


def test_missing_input_without_output_names_the_download_step(tmp_path: Path) -> None:
    args = ["--input-dir", str(tmp_path), "--file-numbers", "4", "--output-dir", str(tmp_path)]

    result = run_module("extract", *args)

    assert result.returncode == 1
    assert "04.jsonl.zst" in result.stderr
    assert "download step" in result.stderr
    assert "Traceback" not in result.stderr


def test_complete_output_is_skipped_and_kept(shards: Path) -> None:
    done = shards / "00.jsonl"
    shard = extract.Shard(shards / "00.jsonl.zst", done)
    assert extract.extract_shard(shard) is True
    stamp = done.stat().st_mtime_ns

    assert extract.extract_shard(shard, remove_downloaded=True) is False

    assert done.read_bytes() == jsonl(500, seed=0) and done.stat().st_mtime_ns == stamp
    assert not shard.source.exists()  # the output was complete, so the download may go
    # With its download gone there is nothing to compare: still complete.
    assert extract.extract_shard(shard) is False


def test_output_of_a_changed_download_is_extracted_again(
    shards: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    done = shards / "00.jsonl"
    shard = extract.Shard(shards / "00.jsonl.zst", done)
    assert extract.extract_shard(shard) is True
    write_zst(shard.source, jsonl(700, seed=7))  # downloaded again, with other contents
    capsys.readouterr()

    assert extract.extract_shard(shard) is True

    assert f"input {shard.source} changed: extracting {done} again" in capsys.readouterr().out
    assert done.read_bytes() == jsonl(700, seed=7)
    assert extract.extract_shard(shard) is False  # and now it is current


def test_output_without_a_record_is_extracted_again(shards: Path) -> None:
    """Written by another tool or an older version: what it was made from is unknown."""
    done = shards / "00.jsonl"
    done.write_bytes(b"made by someone else\n")

    assert extract.extract_shard(extract.Shard(shards / "00.jsonl.zst", done)) is True

    assert done.read_bytes() == jsonl(500, seed=0)


def test_long_window_frames_are_decoded(tmp_path: Path) -> None:
    data = jsonl(200, seed=9)
    source = tmp_path / "long.jsonl.zst"
    write_zst(source, data, window_log=28)  # 256 MiB: above zstd's default decoding limit
    assert zstandard.get_frame_parameters(source.read_bytes()).window_size == 1 << 28

    extract.extract_shard(extract.Shard(source, tmp_path / "long.jsonl"))

    assert (tmp_path / "long.jsonl").read_bytes() == data


def test_several_frames_across_small_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = jsonl(300, seed=1), jsonl(300, seed=2)
    compressor = zstandard.ZstdCompressor()
    stream = io.BytesIO(compressor.compress(first) + compressor.compress(second))
    monkeypatch.setattr(extract, "READ_BYTES", 37)  # frames end in the middle of reads
    out = io.BytesIO()

    assert extract.decompress_stream(stream, out) == len(first) + len(second)
    assert out.getvalue() == first + second


def test_truncated_input_is_an_error_and_leaves_nothing(tmp_path: Path) -> None:
    source = tmp_path / "00.jsonl.zst"
    write_zst(source, jsonl(2000, seed=3))
    source.write_bytes(source.read_bytes()[:-50])
    output = tmp_path / "00.jsonl"

    with pytest.raises(extract.ExtractError, match="00.jsonl.zst.*download step"):
        extract.extract_shard(extract.Shard(source, output), remove_downloaded=True)

    assert not output.exists()
    assert not extract.temp_path(output).exists()
    assert source.exists()  # a failed extraction keeps its input


def test_garbage_input_is_an_error(tmp_path: Path) -> None:
    source = tmp_path / "00.jsonl.zst"
    source.write_bytes(b"<html>Not Found</html>")

    with pytest.raises(extract.ExtractError, match="not valid zstd data"):
        extract.extract_shard(extract.Shard(source, tmp_path / "00.jsonl"))


def test_name_format_must_end_in_zst(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not end in .zst"):
        extract.plan(tmp_path, tmp_path, [0], "{:02d}.jsonl")
    shards = extract.plan(tmp_path / "in", tmp_path / "out", [3], "{:02d}.jsonl.zst")
    assert shards == [extract.Shard(tmp_path / "in/03.jsonl.zst", tmp_path / "out/03.jsonl")]
