"""Download job of the data-preparation recipes: numbered dataset shards, or single files.

One invocation runs one of two modes.

Shards (this task's share of a numbered dataset, e.g. the Pile's 00..29.jsonl.zst):

    python3 -m launcher_scripts.jobs.data_prep.download \\
        --url-base https://host/pile/train --file-numbers 0,3,5-7 --output-dir DIR \\
        [--name-format "{:02d}.jsonl.zst"] [--rank R --world-size W]

    fetches URL_BASE/<name> into DIR/<name> for every file number this task owns. Without
    --rank/--world-size the rank comes from the scheduler's environment (see shards.py).

Single files (tokenizer vocab and merges; repeat --file, one SOURCE DEST pair each):

    python3 -m launcher_scripts.jobs.data_prep.download \\
        --file https://host/gpt2-vocab.json /data/bpe/vocab.json \\
        --file https://host/gpt2-merges.txt /data/bpe/merges.txt

A list of files (e.g. Common Crawl's warc.paths.gz: one path or URL per line, optionally
gzipped, itself a local file or a URL), shared by rank as numbered shards are:

    python3 -m launcher_scripts.jobs.data_prep.download \
        --url-list https://host/warc.paths.gz --list-base https://host/ [--limit N] \
        --output-dir DIR

    fetches each of this task's lines (prefixed with --list-base when it is not a URL itself)
    into DIR/<its file name>; --limit keeps the list's first N lines.

Common options: --retries N (default 5) extra attempts after network errors, HTTP 5xx, 408
and 429, waiting --retry-wait S seconds (default 2) before the first retry and twice as long
before each next one (at most 60 s); --timeout S (default 60) for connecting and for each read.

A source without a URL scheme, or with file://, is a local path and is copied, not downloaded
(for clusters whose compute nodes have no internet access but share a file system).

Contract, so that a job can be killed and re-run at any point:
- data is streamed to <dest>.part and renamed to <dest> only once complete, so the final
  name existing means the file is complete;
- an existing <dest> is skipped; when the server tells the size (HEAD), it must match;
- an existing <dest>.part is resumed with an HTTP "Range: bytes=N-" request; a server that
  ignores Range (answers 200) restarts the file from zero, and a 416 answer is taken as
  "already complete" when the server's total equals the part's size;
- the received size must equal Content-Length (or the Content-Range total) when the server
  gives one;
- a single file (--file) records its source in <dest>.meta.json (fingerprint.py; a local
  source with its size and mtime): when the source changes (another tokenizer URL or file),
  the file is fetched again, saying why, instead of kept.
HTTP 4xx answers other than 408 and 429 fail at once: retrying a missing file cannot help.

Exit status: 0 on success, 1 on failure with a one-line message on stderr, 2 on bad usage.
Only the standard library (urllib) does the transfers; tqdm draws the progress bar.
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import ssl
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from email.message import Message
from http.client import HTTPException, HTTPResponse
from pathlib import Path
from typing import BinaryIO
from urllib.error import HTTPError, URLError
from urllib.parse import urlsplit
from urllib.request import Request, url2pathname, urlopen

from tqdm import tqdm

from launcher_scripts.formats import fingerprint
from launcher_scripts.formats.shards import my_file_numbers, rank_and_world_size, share

CHUNK_BYTES = 1 << 20
MAX_RETRY_WAIT_S = 60.0
# 408 (request timeout) and 429 (rate limited) are the client errors that a later attempt
# can get past; every other 4xx means the request itself is wrong.
RETRYABLE_CLIENT_STATUSES = frozenset({408, 429})
REMOTE_SCHEMES = ("http", "https")
USER_AGENT = "launcher-data-prep/1.0 (python-urllib)"


class DownloadError(Exception):
    """A failure that ends the job, reported as one line."""


class _Retryable(Exception):
    """A failure that another attempt may get past (network error, 5xx, body cut short)."""


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 5
    wait_s: float = 2.0
    timeout_s: float = 60.0

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (1-based): exponential, capped."""
        return min(self.wait_s * 2 ** (retry - 1), MAX_RETRY_WAIT_S)


def part_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".part")


def is_local(source: str) -> bool:
    return urlsplit(source).scheme in ("", "file")


def fetch(source: str, dest: Path, policy: RetryPolicy) -> None:
    """Make `dest` a complete copy of `source` (a URL or a local path)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if is_local(source):
        copy_local(_local_path(source), dest)
    elif urlsplit(source).scheme not in REMOTE_SCHEMES:
        raise DownloadError(f"{source}: only http(s) URLs and local paths are supported")
    elif dest.exists():
        verify_existing(source, dest, policy.timeout_s)
    else:
        download(source, dest, policy)


def made_from(source: str) -> fingerprint.Fingerprint:
    local = [_local_path(source)] if is_local(source) else []
    return fingerprint.make({"source": source}, local)


def fetch_recorded(source: str, dest: Path, policy: RetryPolicy) -> None:
    """fetch, for a small file whose record names its source (a tokenizer file): a `dest`
    fetched from another source, or from a local file changed since, is fetched again and
    replaced only once complete."""
    wanted = made_from(source)
    if dest.exists():
        reasons = fingerprint.stale_reasons(fingerprint.recorded_fingerprint(dest), wanted)
        if not reasons:
            fetch(source, dest, policy)
            return
        _log(f"{'; '.join(reasons)}: fetching {dest} again from {source}")
    staged = dest.with_name(f".{dest.name}.new")
    # What an interrupted earlier attempt left may be another source's bytes: start afresh.
    staged.unlink(missing_ok=True)
    part_path(staged).unlink(missing_ok=True)
    fetch(source, staged, policy)
    _publish_recorded(staged, dest, wanted)


def _publish_recorded(staged: Path, dest: Path, record: fingerprint.Fingerprint) -> None:
    # The old file first and the new one last: its presence marks completion, and its record
    # is then the one written here.
    dest.unlink(missing_ok=True)
    fingerprint.write_record(dest, {"fingerprint": record})
    os.replace(staged, dest)


def _local_path(source: str) -> Path:
    parts = urlsplit(source)
    return Path(url2pathname(parts.path)) if parts.scheme == "file" else Path(source)


def copy_local(src: Path, dest: Path) -> None:
    if not src.is_file():
        raise DownloadError(f"local source {src} does not exist or is not a file")
    if dest.exists():
        _check_existing_size(dest, src.stat().st_size, str(src))
        return
    part = part_path(dest)
    shutil.copyfile(src, part)
    with open(part, "rb+") as copied:
        _sync(copied)
    _finish(part, dest)
    _log(f"copied {src} -> {dest} ({_mb(dest.stat().st_size)})")


def verify_existing(url: str, dest: Path, timeout_s: float) -> None:
    """Skip a file downloaded before; compare its size with the server's when it tells it."""
    try:
        with urlopen(_request(url, method="HEAD"), timeout=timeout_s) as response:
            size = _int_header(response.headers, "Content-Length")
    except (OSError, HTTPException) as exc:
        _log(f"{dest} exists; skipping (size not verified: {_describe(exc)})")
        return
    if size is None:
        _log(f"{dest} exists; skipping (server does not tell the size)")
        return
    _check_existing_size(dest, size, url)


def _check_existing_size(dest: Path, expected: int, source: str) -> None:
    actual = dest.stat().st_size
    if actual != expected:
        raise DownloadError(
            f"{dest} exists with {actual} bytes but {source} has {expected}; "
            "delete it and re-run to fetch it again"
        )
    _log(f"{dest} exists with the expected {actual} bytes; skipping")


def download(url: str, dest: Path, policy: RetryPolicy) -> None:
    """Download `url` to `dest` through `dest`.part, retrying and resuming as the policy says."""
    part = part_path(dest)
    started = time.monotonic()
    received = 0
    last_error: _Retryable | None = None
    for attempt in range(policy.retries + 1):
        if attempt:
            delay = policy.delay(attempt)
            _log(f"retry {attempt}/{policy.retries} of {url} in {delay:g} s: {last_error}")
            time.sleep(delay)
        try:
            received += download_once(url, part, policy.timeout_s)
        except _Retryable as exc:
            last_error = exc
            continue
        _finish(part, dest)
        _log(f"downloaded {url} -> {dest} ({_rate(received, time.monotonic() - started)})")
        return
    raise DownloadError(
        f"giving up on {url} after {policy.retries + 1} attempts; last error: {last_error}"
    )


def download_once(url: str, part: Path, timeout_s: float) -> int:
    """One attempt: bring `part` to the full size. Returns the number of bytes received.

    Raises _Retryable for failures worth another attempt and DownloadError for the others.
    """
    offset = part.stat().st_size if part.exists() else 0
    try:
        response = urlopen(_request(url, offset), timeout=timeout_s)
    except HTTPError as exc:
        exc.close()
        if exc.code == 416 and offset:
            return _after_unsatisfiable_range(url, part, offset, exc.headers, timeout_s)
        raise _http_failure(url, exc) from None
    except URLError as exc:
        if isinstance(exc.reason, ssl.SSLCertVerificationError):
            raise DownloadError(f"{url}: {_describe(exc)}") from None  # the same every time
        raise _Retryable(_describe(exc)) from None
    except (OSError, HTTPException) as exc:
        raise _Retryable(_describe(exc)) from None
    with response:
        start, total = _body_extent(response, offset, url, part)
        received = _write_body(response, part, start, total)
    _check_size(url, part, total)
    return received


def _after_unsatisfiable_range(
    url: str, part: Path, offset: int, headers: Message, timeout_s: float
) -> int:
    # 416 to "bytes=N-" means N is at or past the end: complete if the total is exactly N.
    if _content_range(headers.get("Content-Range"))[2] == offset:
        return 0
    # A part longer than the remote file (or of unknown standing) cannot be trusted; the
    # request from zero carries no Range header, so this cannot come back here.
    _log(f"{part} ({offset} bytes) does not fit {url}; restarting from zero")
    part.unlink()
    return download_once(url, part, timeout_s)


def _http_failure(url: str, exc: HTTPError) -> Exception:
    message = f"HTTP {exc.code} {exc.reason} for {url}"
    if 400 <= exc.code < 500 and exc.code not in RETRYABLE_CLIENT_STATUSES:
        return DownloadError(message)
    return _Retryable(message)


def _body_extent(
    response: HTTPResponse, offset: int, url: str, part: Path
) -> tuple[int, int | None]:
    """Where the body starts in the file and the file's total size, if the server tells it."""
    length = _int_header(response.headers, "Content-Length")
    if response.status != 206:
        if offset:
            _log(f"{url} ignored the Range request; restarting from zero")
        return 0, length
    start, _end, total = _content_range(response.headers.get("Content-Range"))
    if start != offset:
        part.unlink(missing_ok=True)
        raise _Retryable(f"asked for bytes from {offset} but got a range from {start}")
    if total is None and length is not None:
        total = offset + length  # an open-ended range runs to the end of the file
    return start, total


def _write_body(response: HTTPResponse, part: Path, start: int, total: int | None) -> int:
    received = 0
    with (
        open(part, "ab" if start else "wb") as out,
        _progress(part.name.removesuffix(".part"), total, start) as bar,
    ):
        try:
            while chunk := _read(response, received):
                out.write(chunk)
                received += len(chunk)
                bar.update(len(chunk))
        finally:
            # Whatever arrived stays in the .part file for the next attempt to resume from.
            _sync(out)
    return received


def _read(response: HTTPResponse, received: int) -> bytes:
    # Only errors of the connection are worth retrying; local write errors (a full disk)
    # are raised as they are. read1 returns what has arrived instead of waiting to fill the
    # chunk, so a stall that times out loses nothing already received.
    try:
        return response.read1(CHUNK_BYTES)
    except (OSError, HTTPException) as exc:
        raise _Retryable(f"transfer cut after {received} bytes: {_describe(exc)}") from None


def _check_size(url: str, part: Path, total: int | None) -> None:
    size = part.stat().st_size
    if total is None or size == total:
        return
    if size < total:
        raise _Retryable(f"connection closed after {size} of {total} bytes")
    part.unlink()
    raise DownloadError(f"size mismatch for {url}: received {size} bytes, server said {total}")


def _finish(part: Path, dest: Path) -> None:
    os.replace(part, dest)


def _sync(out: BinaryIO) -> None:
    # The final name marks completion, so the data must be on disk before the rename.
    out.flush()
    os.fsync(out.fileno())


def _request(url: str, offset: int = 0, method: str = "GET") -> Request:
    # identity: a compressed transfer would make Content-Length and Range count other bytes.
    headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    return Request(url, headers=headers, method=method)


def _int_header(headers: Message, name: str) -> int | None:
    value = headers.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _content_range(value: str | None) -> tuple[int | None, int | None, int | None]:
    """Parse "bytes 5-9/10" or "bytes */10" into (start, end, total); None where absent."""
    if not value or not value.startswith("bytes "):
        return None, None, None
    span, _, total_text = value[len("bytes ") :].partition("/")
    first, _, last = span.partition("-")
    return _int_or_none(first), _int_or_none(last), _int_or_none(total_text)


def _int_or_none(text: str) -> int | None:
    return int(text) if text.strip().isdigit() else None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, URLError) and not isinstance(exc, HTTPError):
        return f"{type(exc).__name__}: {exc.reason}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


@contextmanager
def _progress(label: str, total: int | None, initial: int) -> Iterator[tqdm]:
    # In a batch log (not a TTY) every redraw is a line of its own: redraw rarely there.
    interactive = sys.stderr.isatty()
    with tqdm(
        total=total,
        initial=initial,
        desc=label,
        unit="B",
        unit_scale=True,
        file=sys.stderr,
        mininterval=0.2 if interactive else 30.0,
        dynamic_ncols=interactive,
    ) as bar:
        yield bar


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def _rate(size: int, seconds: float) -> str:
    return f"{_mb(size)} in {seconds:.1f} s, {size / 1e6 / max(seconds, 1e-6):.1f} MB/s"


def _log(message: str) -> None:
    print(message, flush=True)


def plan_shards(
    url_base: str, numbers: Sequence[int], output_dir: Path, name_format: str
) -> list[tuple[str, Path]]:
    """The (source, destination) pairs for the given file numbers."""
    base = url_base.rstrip("/")
    return [(f"{base}/{name}", output_dir / name) for name in _names(numbers, name_format)]


def _names(numbers: Sequence[int], name_format: str) -> list[str]:
    try:
        return [name_format.format(number) for number in numbers]
    except (IndexError, KeyError, ValueError) as exc:
        raise ValueError(f"--name-format {name_format!r} does not format a number: {exc}") from None


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 -m launcher_scripts.jobs.data_prep.download",
        description="Download dataset shards (--url-base) or single files (--file).",
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--url-base", help="URL (or directory) that holds the numbered files")
    mode.add_argument("--url-list", help="a file or URL listing one path or URL per line")
    mode.add_argument(
        "--file",
        action="append",
        nargs=2,
        metavar=("SOURCE", "DEST"),
        help="download (or copy) SOURCE to DEST; repeat for several files",
    )
    parser.add_argument("--file-numbers", help="numbers and ranges, e.g. '0,3,5-7'")
    parser.add_argument("--output-dir", type=Path, help="directory for the shards")
    parser.add_argument("--name-format", default="{:02d}.jsonl.zst")
    parser.add_argument("--list-base", default="", help="prefixed to relative --url-list lines")
    parser.add_argument("--limit", type=int, help="only the first N lines of --url-list")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world-size", type=int)
    parser.add_argument("--retries", type=int, default=5, help="extra attempts (default 5)")
    parser.add_argument("--retry-wait", type=float, default=2.0, help="first backoff, seconds")
    parser.add_argument("--timeout", type=float, default=60.0, help="socket timeout, seconds")
    args = parser.parse_args(argv)
    if args.url_base is not None and (args.file_numbers is None or args.output_dir is None):
        parser.error("--url-base needs --file-numbers and --output-dir")
    if args.url_list is not None and args.output_dir is None:
        parser.error("--url-list needs --output-dir")
    if args.retries < 0 or args.retry_wait < 0 or args.timeout <= 0:
        parser.error("--retries and --retry-wait must be >= 0 and --timeout > 0")
    return args


def plan_list(
    lines: Sequence[str], base: str, output_dir: Path, limit: int | None, rank: int, world: int
) -> list[tuple[str, Path]]:
    """This task's (source, destination) pairs of a list of paths or URLs."""
    entries = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    entries = entries[:limit] if limit is not None else entries
    names = [Path(entry.split("?")[0]).name for entry in entries]
    if len(set(names)) != len(names):  # over the whole list: two tasks must not meet either
        raise ValueError("--url-list names two files the same: their last path parts must differ")
    pairs = []
    for entry, name in share(list(zip(entries, names, strict=True)), rank, world):
        if base and "://" not in entry:
            entry = f"{base.rstrip('/')}/{entry.lstrip('/')}"
        pairs.append((entry, output_dir / name))
    return pairs


def _listed(args: argparse.Namespace, policy: RetryPolicy, rank: int) -> list[str]:
    source = str(args.url_list)
    local = Path(source.removeprefix("file://"))
    if "://" in source and not source.startswith("file://"):
        # A copy per task: tasks sharing a file system would otherwise write one .part.
        local = args.output_dir / f".url-list-{rank}-{Path(source).name}"
        fetch(source, local, policy)
    data = local.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return data.decode("utf-8").splitlines()


def _jobs(args: argparse.Namespace, policy: RetryPolicy) -> list[tuple[str, Path]]:
    if args.file:
        return [(source, Path(dest)) for source, dest in args.file]
    if args.url_list:
        rank, world = rank_and_world_size(rank=args.rank, world_size=args.world_size)
        pairs = plan_list(
            _listed(args, policy, rank), args.list_base, args.output_dir, args.limit, rank, world
        )
        _log(f"task {rank} of {world}: {len(pairs)} files of the list")
        return pairs
    numbers = my_file_numbers(args.file_numbers, args.rank, args.world_size)
    return plan_shards(args.url_base, numbers, args.output_dir, args.name_format)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    policy = RetryPolicy(retries=args.retries, wait_s=args.retry_wait, timeout_s=args.timeout)
    try:
        for source, dest in _jobs(args, policy):
            (fetch_recorded if args.file else fetch)(source, dest, policy)
    except (DownloadError, ValueError, OSError) as exc:
        print(f"download: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("download: interrupted; re-run to resume from the .part files", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
