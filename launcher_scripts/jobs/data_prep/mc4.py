"""mC4 job program: download, tokenize and merge the files of chosen languages.

    python3 -m launcher_scripts.jobs.data_prep.mc4 download --url-base URL --c4-dir DIR \\
        --languages cs:1024,en:1024 [--cleaned-english]
    python3 -m launcher_scripts.jobs.data_prep.mc4 preprocess --c4-dir DIR --output-dir OUT \\
        --languages cs:1024,en:1024 [--cleaned-english] --tokenizer-model mt5.model \\
        [--workers N] [--remove-downloaded]
    python3 -m launcher_scripts.jobs.data_prep.mc4 merge --output-dir OUT \\
        --languages cs:1024,en:1024 [--cleaned-english]

The files are those of the allenai/c4 dataset, named from each language's file count (LANG:COUNT):
`multilingual/c4-LANG.tfrecord-NNNNN-of-COUNT.json.gz`, and for English with
--cleaned-english the cleaned C4 `en/c4-train.NNNNN-of-COUNT.json.gz`. They are downloaded
from URL/<name> into DIR/<name>, the layout of a clone of the dataset's repository.

download and preprocess share the files by rank (every world_size-th file of the list, which is
ordered by language, so each task gets a like share of every language), and task i tokenizes
exactly the files task i downloaded. preprocess writes one dataset per file under
OUT/.mc4_files/; merge, once every task is done, concatenates each language's files into
OUT/mc4_LANG_text_document (languages shared by rank) and deletes them. A language whose
dataset is complete and current is skipped by all three steps, so the steps can be re-run at
any point. Current: its record (fingerprint.py) names the same tokenizer (by content) and the
same files, unchanged where they are still there; download checks this when given
--tokenizer-model, merge from the per-file datasets' records. A language made with another
tokenizer is tokenized and merged again, each step saying why.

No end-of-document token is appended: megatron-core's T5 dataset, which mT5 trains on, takes
document boundaries from the .idx and adds its own sentinels.

Exit status: 0 on success, 1 on failure with a one-line message on stderr, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from launcher_scripts.formats import fingerprint, indexed_writer, shards
from launcher_scripts.formats.mc4_files import (
    PARTS_DIR,
    TEXT_KEY,
    Mc4File,
    dataset_prefix,
    part_prefix,
    plan_files,
)
from launcher_scripts.jobs.data_prep import download, preprocess


class Mc4Error(Exception):
    """A failure that ends the job, reported as one line."""


def parse_languages(spec: str) -> list[tuple[str, int]]:
    """Parse "cs:1024,en:11264" into [("cs", 1024), ("en", 11264)]."""
    languages: list[tuple[str, int]] = []
    for part in spec.split(","):
        language, sep, count = part.strip().partition(":")
        if not sep or not language or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--languages part {part!r} is not LANG:COUNT, e.g. 'cs:1024'")
        if any(language == seen for seen, _ in languages):
            raise ValueError(f"--languages names {language!r} twice")
        languages.append((language, int(count)))
    return languages


def encoding_options(tokenizer_model: str) -> list[str]:
    """The preprocess options every mC4 file is tokenized with."""
    return ["--text-key", TEXT_KEY, "--tokenizer-model", tokenizer_model, "--no-append-eod"]


def made_from(tokenizer_model: str, inputs: Sequence[Path]) -> fingerprint.Fingerprint:
    """The fingerprint preprocess records for a dataset of `inputs` (a file's, or a
    language's: the union of its files')."""
    argv = ["--input", *map(str, inputs), "--output-dir", ".", *encoding_options(tokenizer_model)]
    return preprocess.made_from(preprocess.build_parser().parse_args(argv), inputs)


class Finished:
    """Which languages already have their complete dataset (each looked up once); with a
    tokenizer, only those made from it and from the language's files as they are now."""

    def __init__(
        self,
        output_dir: Path | None,
        files: Sequence[Mc4File] = (),
        c4_dir: Path | None = None,
        tokenizer_model: str | None = None,
    ) -> None:
        self.output_dir = output_dir
        self.files, self.c4_dir, self.tokenizer_model = files, c4_dir, tokenizer_model
        self._known: dict[str, bool] = {}

    def __call__(self, language: str) -> bool:
        if self.output_dir is None:
            return False
        if language not in self._known:
            prefix = dataset_prefix(self.output_dir, language)
            complete = indexed_writer.is_complete(prefix)
            self._known[language] = complete and self._current(prefix, language)
        return self._known[language]

    def _current(self, prefix: Path, language: str) -> bool:
        if self.tokenizer_model is None or self.c4_dir is None:
            return True
        inputs = [self.c4_dir / f.name for f in self.files if f.language == language]
        reasons = preprocess.stale_reasons(prefix, made_from(self.tokenizer_model, inputs))
        if reasons:
            print(f"{'; '.join(reasons)}: redoing {prefix.name}", flush=True)
        return not reasons


def my_share(args: argparse.Namespace, items: Sequence[Mc4File]) -> list[Mc4File]:
    rank, world_size = shards.rank_and_world_size(rank=args.rank, world_size=args.world_size)
    mine = shards.share(items, rank, world_size)
    print(f"task {rank} of {world_size}: {len(mine)} of {len(items)} files", flush=True)
    return mine


# ---- steps -------------------------------------------------------------------------------


def run_download(args: argparse.Namespace) -> int:
    files = plan_files(args.languages, args.cleaned_english)
    finished = Finished(args.output_dir, files, args.c4_dir, args.tokenizer_model)
    policy = download.RetryPolicy(args.retries, args.retry_wait, args.timeout)
    base = args.url_base.rstrip("/")
    for file in my_share(args, files):
        if finished(file.language):
            continue  # tokenized and merged already; its files may have been removed
        if args.output_dir and _tokenized(args, file):
            print(f"skip {file.name}: already tokenized", flush=True)
            continue
        download.fetch(f"{base}/{file.name}", args.c4_dir / file.name, policy)
    return 0


def _tokenized(args: argparse.Namespace, file: Mc4File) -> bool:
    """Whether the file's own dataset is complete (and, with a tokenizer, current)."""
    prefix = part_prefix(args.output_dir, file)
    if not indexed_writer.is_complete(prefix):
        return False
    if args.tokenizer_model is None:
        return True
    wanted = made_from(args.tokenizer_model, [args.c4_dir / file.name])
    return not preprocess.stale_reasons(prefix, wanted)


def run_preprocess(args: argparse.Namespace) -> int:
    files = plan_files(args.languages, args.cleaned_english)
    finished = Finished(args.output_dir, files, args.c4_dir, args.tokenizer_model)
    mine = [file for file in my_share(args, files) if not finished(file.language)]
    if not mine:
        print("nothing to tokenize: every language of this task is complete", flush=True)
        return 0
    argv = ["--input", *(str(args.c4_dir / file.name) for file in mine)]
    argv += ["--output-dir", str(args.output_dir / PARTS_DIR)]
    argv += encoding_options(args.tokenizer_model)
    argv += ["--max-bad-fraction", str(args.max_bad_fraction)]
    # This task's share is chosen above; preprocess must take all of it.
    argv += ["--rank", "0", "--world-size", "1"]
    if args.workers is not None:
        argv += ["--workers", str(args.workers)]
    if args.remove_downloaded:
        argv.append("--remove-inputs")
    return preprocess.main(argv)


def run_merge(args: argparse.Namespace) -> int:
    files = plan_files(args.languages, args.cleaned_english)
    rank, world_size = shards.rank_and_world_size(rank=args.rank, world_size=args.world_size)
    counts = dict(args.languages)
    mine = balanced_share([language for language, _ in args.languages], counts, rank, world_size)
    print(f"task {rank} of {world_size}: languages {', '.join(mine) or 'none'}", flush=True)
    for language in mine:
        parts = [part_prefix(args.output_dir, file) for file in files if file.language == language]
        merge_language(dataset_prefix(args.output_dir, language), parts)
    with contextlib.suppress(OSError):  # the last task to finish finds it empty
        (args.output_dir / PARTS_DIR).rmdir()
    return 0


def merge_language(prefix: Path, parts: Sequence[Path]) -> None:
    """Make `prefix` the concatenation of the per-file datasets `parts`, then delete them.

    A complete dataset is kept when the parts there are (none: preprocess found it current)
    were made as its record says (leftovers of a merge that stopped before deleting them);
    parts made otherwise (another tokenizer) replace it.
    """
    done = [part for part in parts if indexed_writer.is_complete(part)]
    complete = indexed_writer.is_complete(prefix)
    made = combined_fingerprint(prefix, done) if done else None
    if complete and (not done or _covers(fingerprint.recorded_fingerprint(prefix), made)):
        print(f"skip {prefix.name}: already complete", flush=True)
    else:
        missing = [part for part in parts if part not in done]
        if missing:
            raise Mc4Error(
                f"{len(missing)} of the {len(parts)} files of {prefix.name} are not tokenized "
                f"(first: {missing[0].name}); re-run the preprocess step"
            )
        if complete:
            reasons = preprocess.stale_reasons(prefix, made) if made else ["parts changed"]
            print(f"{'; '.join(reasons)}: redoing {prefix.name}", flush=True)
        preprocess.publish_parts(parts, prefix, made)
        header = indexed_writer.read_header(indexed_writer.idx_path(prefix))
        print(
            f"merged {len(parts)} files into {prefix} ({header.documents - 1} documents)",
            flush=True,
        )
    _remove_datasets(parts)


def combined_fingerprint(prefix: Path, parts: Sequence[Path]) -> fingerprint.Fingerprint | None:
    """The fingerprint of a language made of `parts`: their common settings and tokenizer and
    all their inputs. None when a part has no record."""
    recorded = [fingerprint.recorded_fingerprint(part) for part in parts]
    if any(made is None for made in recorded):
        return None
    first = recorded[0]
    assert first is not None
    inputs: dict[str, object] = {}
    for made in recorded:
        assert made is not None
        if (made.get("settings"), made.get("tokenizer")) != (
            first.get("settings"),
            first.get("tokenizer"),
        ):
            raise Mc4Error(
                f"the files of {prefix.name} were tokenized with different tokenizers or "
                "settings; re-run the preprocess step"
            )
        inputs.update(made.get("inputs", {}))
    return {
        "settings": first.get("settings"),
        "tokenizer": first.get("tokenizer"),
        "inputs": inputs,
    }


def _covers(recorded: fingerprint.Fingerprint | None, made: fingerprint.Fingerprint | None) -> bool:
    """Whether parts made as `made` are part of a dataset recorded as `recorded`."""
    if recorded is None or made is None:
        return False
    then = recorded.get("inputs", {})
    return (
        recorded.get("settings") == made.get("settings")
        and recorded.get("tokenizer") == made.get("tokenizer")
        and all(path in then and then[path] == state for path, state in made["inputs"].items())
    )


def _remove_datasets(prefixes: Iterable[Path]) -> None:
    for prefix in prefixes:
        indexed_writer.bin_path(prefix).unlink(missing_ok=True)
        indexed_writer.idx_path(prefix).unlink(missing_ok=True)
        fingerprint.remove_record(prefix)


def balanced_share(
    languages: Sequence[str], counts: dict[str, int], rank: int, world_size: int
) -> list[str]:
    """This task's languages: the biggest first, each to the task with the fewest files so
    far (merging copies every byte, so the work follows the file counts)."""
    loads = [0] * world_size
    owners: dict[str, int] = {}
    for language in sorted(languages, key=lambda name: (-counts[name], languages.index(name))):
        owner = loads.index(min(loads))
        owners[language] = owner
        loads[owner] += counts[language]
    return [language for language in languages if owners[language] == rank]


# ---- command line ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 -m launcher_scripts.jobs.data_prep.mc4",
        description="Download, tokenize and merge mC4 files, one dataset per language.",
    )
    steps = parser.add_subparsers(dest="step", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--languages", required=True, type=_languages, metavar="LANG:COUNT,...")
    common.add_argument("--cleaned-english", action="store_true", help="en from cleaned C4")
    common.add_argument("--rank", type=int)
    common.add_argument("--world-size", type=int)

    fetch = steps.add_parser("download", parents=[common], help="download this task's files")
    fetch.add_argument("--c4-dir", required=True, type=Path, help="where the files are kept")
    fetch.add_argument("--url-base", required=True, help="URL (or folder) holding the files")
    fetch.add_argument(
        "--output-dir", type=Path, help="the datasets' folder: files already tokenized are skipped"
    )
    fetch.add_argument(
        "--tokenizer-model",
        help="the preprocess step's tokenizer: files tokenized with another are fetched again",
    )
    fetch.add_argument("--retries", type=int, default=5, help="extra attempts (default 5)")
    fetch.add_argument("--retry-wait", type=float, default=2.0, help="first backoff, seconds")
    fetch.add_argument("--timeout", type=float, default=60.0, help="socket timeout, seconds")

    tokenize = steps.add_parser("preprocess", parents=[common], help="tokenize this task's files")
    tokenize.add_argument("--c4-dir", required=True, type=Path, help="where the files are kept")
    tokenize.add_argument("--output-dir", required=True, type=Path)
    tokenize.add_argument("--tokenizer-model", required=True, help="SentencePiece .model")
    tokenize.add_argument("--workers", type=int, help="processes (default: all usable CPUs)")
    tokenize.add_argument("--max-bad-fraction", type=float, default=0.01)
    tokenize.add_argument(
        "--remove-downloaded", action="store_true", help="delete each file once tokenized"
    )

    merge = steps.add_parser("merge", parents=[common], help="one dataset per language")
    merge.add_argument("--output-dir", required=True, type=Path)
    return parser


def _languages(text: str) -> list[tuple[str, int]]:
    try:
        return parse_languages(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


STEPS = {"download": run_download, "preprocess": run_preprocess, "merge": run_merge}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return STEPS[args.step](args)
    except (Mc4Error, download.DownloadError, ValueError, OSError) as error:
        print(f"mc4 {args.step}: error: {error}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print(f"mc4 {args.step}: interrupted; re-run to resume", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
