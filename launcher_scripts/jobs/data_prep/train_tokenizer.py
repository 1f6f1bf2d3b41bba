"""Train a SentencePiece tokenizer, or a BERT WordPiece vocabulary, on text files or on the
datasets preprocess reads.

    python3 -m launcher_scripts.jobs.data_prep.train_tokenizer --input data.jsonl \\
        --model-prefix out/tokenizer --vocab-size 8000

`--model-type wordpiece` writes NAME.vocab.txt: a vocab.txt as BERT's (and the T5 recipes')
WordPiece tokenizers read it, [PAD] [UNK] [CLS] [SEP] [MASK] first, trained by the `tokenizers`
library with BERT's normalizer (lower-cased with --lower-case) and pre-tokenizer.

Plain text inputs (anything but .json/.jsonl(.gz) and directories) go to SentencePiece as
files in --input-format (`text`: a sentence per line; `tsv`: sentence<TAB>count). Datasets
go through a sentence iterator: every non-blank line of every document.

The model is trained under a temporary prefix and renamed into place, .vocab first and
.model last, so a present .model means a finished tokenizer. Its record (NAME.model.meta.json,
see fingerprint.py) holds the training settings and the inputs' sizes and mtimes: a finished
tokenizer is not trained again unless they changed (another vocab size, an edited input), in
which case the job says why and trains it anew.
"""

from __future__ import annotations

import argparse
import gzip
import os
import sys
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from launcher_scripts.files import write_atomic
from launcher_scripts.formats import fingerprint
from launcher_scripts.formats.tokenizer import trained_tokenizer_file
from launcher_scripts.jobs import benign_warnings
from launcher_scripts.jobs.data_prep import readers

# SentencePiece's model types, and BERT's WordPiece.
MODEL_TYPES = ("bpe", "unigram", "char", "word", "wordpiece")
WORDPIECE_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# What reading a truncated or corrupt (gzip) input raises.
UNREADABLE_INPUT: tuple[type[BaseException], ...] = (EOFError, gzip.BadGzipFile, zlib.error)


class TrainError(Exception):
    """An expected failure, reported as one line without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 -m launcher_scripts.jobs.data_prep.train_tokenizer",
        description="Train a SentencePiece tokenizer.",
    )
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="text files, or .json/.jsonl/.json.gz/.jsonl.gz files or directories of text files",
    )
    parser.add_argument("--text-key", default="text", help="JSON key of the document text")
    parser.add_argument(
        "--model-prefix", required=True, metavar="DIR/NAME", help="writes NAME.model, NAME.vocab"
    )
    parser.add_argument("--model-type", default="bpe", choices=MODEL_TYPES)
    parser.add_argument(
        "--lower-case", action="store_true", help="wordpiece: lower-case and strip accents"
    )
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--character-coverage", type=float, default=0.9995)
    parser.add_argument("--unk-id", type=int, default=1)
    parser.add_argument("--bos-id", type=int, default=2)
    parser.add_argument("--eos-id", type=int, default=3)
    parser.add_argument("--pad-id", type=int, default=0)
    parser.add_argument(
        "--input-format",
        default="text",
        choices=("text", "tsv"),
        help="format of plain text inputs (datasets are always read as documents)",
    )
    parser.add_argument(
        "--max-sentences",
        type=int,
        metavar="N",
        help="train on a random sample of at most N sentences (default: all)",
    )
    return parser


def is_dataset(path: Path) -> bool:
    return path.is_dir() or readers.is_json_input(path)


def plain_text_lines(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as stream:
        for line in stream:
            line = line.rstrip("\n")
            if line.strip():
                yield line


def sentences(paths: Sequence[Path], text_key: str, stats: readers.ReadStats) -> Iterator[str]:
    """Every sentence of the inputs, in order: dataset documents' lines and text files' lines."""
    for path in paths:
        try:
            if is_dataset(path):
                yield from readers.sentence_iterator([path], text_key, stats)
            else:
                yield from plain_text_lines(path)
        except UNREADABLE_INPUT as error:
            raise TrainError(
                f"{path} cannot be read to its end ({type(error).__name__}: {error}): it is "
                "truncated or corrupt. Replace it and re-run"
            ) from None


def trainer_options(args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    options: dict[str, Any] = {
        "model_prefix": prefix,
        "model_type": args.model_type,
        "vocab_size": args.vocab_size,
        "character_coverage": args.character_coverage,
        "unk_id": args.unk_id,
        "bos_id": args.bos_id,
        "eos_id": args.eos_id,
        "pad_id": args.pad_id,
        "num_threads": os.cpu_count() or 1,
        # INFO (0) prints absl's "WARNING: All log messages before absl::InitializeLog()" and
        # the whole trainer spec; warnings and errors still show, and errors raise.
        "minloglevel": 0 if benign_warnings.showing_all() else 1,
    }
    if args.max_sentences:
        options["input_sentence_size"] = args.max_sentences
        options["shuffle_input_sentence"] = True
    return options


def made_from(args: argparse.Namespace) -> fingerprint.Fingerprint:
    """What the trained model depends on: every trainer setting and the inputs as they are.
    (num_threads is left out: SentencePiece's result does not depend on it.)"""
    settings = {
        name: getattr(args, name)
        for name in (
            "text_key", "model_type", "vocab_size", "character_coverage", "unk_id", "bos_id",
            "eos_id", "pad_id", "input_format", "max_sentences", "lower_case",
        )
    }  # fmt: skip
    return fingerprint.make(settings, [Path(raw) for raw in args.input])


def up_to_date(args: argparse.Namespace) -> bool:
    """Whether the output exists, made from the same inputs and settings (else it says why
    it trains again). Missing inputs are an error either way."""
    model = trained_tokenizer_file(args.model_prefix, args.model_type)
    missing = [raw for raw in args.input if not Path(raw).exists()]
    if missing:
        raise TrainError(f"input {', '.join(missing)} does not exist")
    if not model.exists():
        return False
    reasons = fingerprint.stale_reasons(fingerprint.recorded_fingerprint(model), made_from(args))
    if not reasons:
        print(f"skip: {model} already exists")
        return True
    print(f"{'; '.join(reasons)}: training {model} again")
    return False


def train(args: argparse.Namespace) -> Path:
    """Train unless a model made from the same inputs and settings exists; returns the .model
    (or .vocab.txt) path."""
    if args.model_type == "wordpiece":
        return train_wordpiece(args)
    import sentencepiece

    prefix = Path(args.model_prefix)
    model = Path(f"{prefix}.model")
    wanted = made_from(args)
    if up_to_date(args):
        return model
    paths = [Path(raw) for raw in args.input]
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp_prefix = prefix.with_name(f".{prefix.name}.tmp-{os.getpid()}")
    options = trainer_options(args, str(tmp_prefix))
    stats = readers.ReadStats()
    if any(is_dataset(path) for path in paths):
        if args.input_format == "tsv":
            raise TrainError("--input-format tsv applies to text files only, not to datasets")
        options["sentence_iterator"] = sentences(paths, args.text_key, stats)
    else:
        options["input"] = ",".join(str(path) for path in paths)
        options["input_format"] = args.input_format
    print(
        f"training a {args.model_type} tokenizer of {args.vocab_size} pieces on "
        f"{len(paths)} input(s)",
        flush=True,
    )
    try:
        sentencepiece.SentencePieceTrainer.train(**options)
    except TrainError:
        _cleanup(tmp_prefix)
        raise
    except (RuntimeError, OSError) as error:
        _cleanup(tmp_prefix)
        raise TrainError(f"SentencePiece training failed: {error}") from None
    finally:
        for line in readers.report_bad(stats, "inputs"):
            print(line, file=sys.stderr)
    # The old .model first and the new one last: its presence marks a finished tokenizer,
    # whose record is then the one written here.
    model.unlink(missing_ok=True)
    fingerprint.write_record(model, {"fingerprint": wanted})
    os.replace(f"{tmp_prefix}.vocab", f"{prefix}.vocab")
    os.replace(f"{tmp_prefix}.model", model)
    print(f"wrote {model} and {prefix}.vocab")
    return model


def train_wordpiece(args: argparse.Namespace) -> Path:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    vocab = trained_tokenizer_file(args.model_prefix, "wordpiece")
    if up_to_date(args):
        return vocab
    paths = [Path(raw) for raw in args.input]
    if args.input_format == "tsv":
        raise TrainError("--input-format tsv is SentencePiece's: give text or dataset inputs")
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(
        lowercase=args.lower_case, strip_accents=args.lower_case
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=args.vocab_size, special_tokens=list(WORDPIECE_SPECIALS), show_progress=False
    )
    print(
        f"training a WordPiece vocabulary of {args.vocab_size} tokens on {len(paths)} input(s)",
        flush=True,
    )
    stats = readers.ReadStats()
    try:
        tokenizer.train_from_iterator(sentences(paths, args.text_key, stats), trainer)
    finally:
        for line in readers.report_bad(stats, "inputs"):
            print(line, file=sys.stderr)
    ordered = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    vocab.parent.mkdir(parents=True, exist_ok=True)
    vocab.unlink(missing_ok=True)
    fingerprint.write_record(vocab, {"fingerprint": made_from(args)})
    write_atomic(vocab, "".join(f"{token}\n" for token, _ in ordered))
    print(f"wrote {vocab} ({len(ordered)} tokens)")
    return vocab


def _cleanup(prefix: Path) -> None:
    for suffix in (".model", ".vocab"):
        Path(f"{prefix}{suffix}").unlink(missing_ok=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        train(args)
    except TrainError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
