"""Extraction job of the data-preparation recipes: .jsonl.zst shards to .jsonl.

    python3 -m launcher_scripts.jobs.data_prep.extract \\
        --input-dir DIR --file-numbers 0-29 --output-dir DIR \\
        [--name-format "{:02d}.jsonl.zst"] [--remove-downloaded] [--rank R --world-size W]

Each of this task's files INPUT_DIR/<name> is decompressed as a stream (constant memory,
whatever the file size) into OUTPUT_DIR/<name without .zst>. Without --rank/--world-size the
rank comes from the scheduler's environment (see shards.py).

Contract, so that a job can be killed and re-run at any point:
- the output is written to <output>.tmp and renamed once complete, so the final name
  existing means the extraction finished; such outputs are skipped, unless the .zst they were
  extracted from has changed since (its size and mtime are recorded in <output>.meta.json,
  see fingerprint.py): then the output is extracted again, saying why;
- --remove-downloaded deletes the .zst once its output is complete (also for outputs that
  an earlier run completed);
- a missing input is fine when its output exists (a re-run after --remove-downloaded), and
  an error naming the file otherwise;
- a truncated or corrupt input is an error naming the file; its partial output is deleted.

Exit status: 0 on success, 1 on failure with a one-line message on stderr, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import zstandard
from tqdm import tqdm

from launcher_scripts.formats import fingerprint
from launcher_scripts.formats.shards import my_file_numbers

READ_BYTES = 1 << 20
# The Pile's frames declare windows beyond the 128 MiB that zstd decodes by default; 2 GiB is
# zstd's largest window, and the decoder allocates only what a frame actually declares.
MAX_WINDOW_SIZE = 1 << 31
SUFFIX = ".zst"


class ExtractError(Exception):
    """A failure that ends the job, reported as one line."""


@dataclass(frozen=True)
class Shard:
    source: Path
    output: Path


def temp_path(output: Path) -> Path:
    # A suffix after .jsonl keeps half-written files out of later steps' "*.jsonl" globs.
    return output.with_name(output.name + ".tmp")


def plan(
    input_dir: Path, output_dir: Path, numbers: Sequence[int], name_format: str
) -> list[Shard]:
    shards = []
    for number in numbers:
        name = _format_name(name_format, number)
        if not name.endswith(SUFFIX):
            raise ValueError(f"--name-format gives {name!r}, which does not end in {SUFFIX}")
        shards.append(Shard(input_dir / name, output_dir / name[: -len(SUFFIX)]))
    return shards


def _format_name(name_format: str, number: int) -> str:
    try:
        return name_format.format(number)
    except (IndexError, KeyError, ValueError) as exc:
        raise ValueError(f"--name-format {name_format!r} does not format a number: {exc}") from None


def made_from(shard: Shard) -> fingerprint.Fingerprint:
    return fingerprint.make({}, [shard.source])


def extract_shard(shard: Shard, remove_downloaded: bool = False) -> bool:
    """Make shard.output complete and current. Returns False when it was already."""
    wanted = made_from(shard)
    if shard.output.exists():
        reasons = fingerprint.stale_reasons(fingerprint.recorded_fingerprint(shard.output), wanted)
        if not reasons:
            _log(f"{shard.output} exists; skipping")
            _remove_source(shard, remove_downloaded)
            return False
        _log(f"{'; '.join(reasons)}: extracting {shard.output} again")
    if not shard.source.exists():
        raise ExtractError(
            f"{shard.source} does not exist and neither does {shard.output}; "
            "run the download step first"
        )
    started = time.monotonic()
    written = decompress_file(shard.source, shard.output, wanted)
    seconds = time.monotonic() - started
    _log(
        f"extracted {shard.source} -> {shard.output} ({written / 1e6:.1f} MB in {seconds:.1f} s, "
        f"{written / 1e6 / max(seconds, 1e-6):.1f} MB/s)"
    )
    _remove_source(shard, remove_downloaded)
    return True


def _remove_source(shard: Shard, remove_downloaded: bool) -> None:
    if remove_downloaded and shard.source.exists():
        shard.source.unlink()
        _log(f"removed {shard.source}")


def decompress_file(
    source: Path, output: Path, made_from: fingerprint.Fingerprint | None = None
) -> int:
    """Decompress `source` into `output` through a temporary name, recorded with `made_from`.
    Returns bytes written."""
    output.parent.mkdir(parents=True, exist_ok=True)
    temp = temp_path(output)
    size = source.stat().st_size
    if size == 0:
        raise ExtractError(f"{source} is empty; delete it and run the download step again")
    try:
        with (
            open(source, "rb") as src,
            open(temp, "wb") as out,
            _progress(source.name, size) as bar,
        ):
            written = decompress_stream(src, out, bar.update)
            out.flush()
            # The final name marks completion, so the data must be on disk before the rename.
            os.fsync(out.fileno())
    except zstandard.ZstdError as exc:
        temp.unlink(missing_ok=True)
        raise ExtractError(
            f"{source} is not valid zstd data ({exc}); delete it and run the download step again"
        ) from None
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    # The old output first and the new one last: the output marks completion, and its record
    # is then the one written here.
    output.unlink(missing_ok=True)
    if made_from is None:
        fingerprint.remove_record(output)
    else:
        fingerprint.write_record(output, {"fingerprint": made_from})
    os.replace(temp, output)
    return written


def decompress_stream(
    src: BinaryIO, out: BinaryIO, on_read: Callable[[int], object] = lambda n: None
) -> int:
    """Decompress every zstd frame of `src` into `out`, holding one chunk at a time.

    Unlike zstandard's stream_reader, which ends quietly at the end of a truncated input,
    this raises ZstdError when the input ends inside a frame.
    """
    dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_SIZE)
    frame = dctx.decompressobj()
    inside_frame = False
    written = 0
    while chunk := src.read(READ_BYTES):
        on_read(len(chunk))
        while chunk:
            data = frame.decompress(chunk)
            out.write(data)
            written += len(data)
            inside_frame = not frame.eof
            # A file may hold several frames one after another: go on with a fresh decoder.
            chunk = frame.unused_data if frame.eof else b""
            if frame.eof:
                frame = dctx.decompressobj()
    if inside_frame:
        raise zstandard.ZstdError("input ends in the middle of a frame (truncated download?)")
    return written


def _progress(label: str, total: int) -> tqdm:
    # In a batch log (not a TTY) every redraw is a line of its own: redraw rarely there.
    interactive = sys.stderr.isatty()
    return tqdm(
        total=total,
        desc=label,
        unit="B",
        unit_scale=True,
        file=sys.stderr,
        mininterval=0.2 if interactive else 30.0,
        dynamic_ncols=interactive,
    )


def _log(message: str) -> None:
    print(message, flush=True)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 -m launcher_scripts.jobs.data_prep.extract",
        description="Decompress .jsonl.zst shards into .jsonl files.",
    )
    parser.add_argument("--input-dir", type=Path, required=True)
    parser.add_argument("--file-numbers", required=True, help="numbers and ranges, e.g. '0-29'")
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--name-format", default="{:02d}.jsonl.zst")
    parser.add_argument(
        "--remove-downloaded", action="store_true", help="delete each .zst once extracted"
    )
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world-size", type=int)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        numbers = my_file_numbers(args.file_numbers, args.rank, args.world_size)
        for shard in plan(args.input_dir, args.output_dir, numbers, args.name_format):
            extract_shard(shard, args.remove_downloaded)
    except (ExtractError, ValueError, OSError) as exc:
        print(f"extract: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("extract: interrupted; re-run to start the unfinished files again", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
