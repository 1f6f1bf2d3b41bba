"""Load a tokenizer from local files and encode documents for the data-preparation jobs.

Formats:
  * SentencePiece `.model` (encoded with the sentencepiece library);
  * Hugging Face `tokenizer.json`;
  * GPT-2 `vocab.json` + `merges.txt`, built into the byte-level BPE that GPT-2's Hugging Face
    tokenizer is (with its end-of-text token matched as a special token in text, as HF does);
  * a BERT WordPiece `vocab.txt` alone (Megatron's BertWordPieceCase / BertWordPieceLowerCase),
    built into the `tokenizers` library's BERT WordPiece: BertNormalizer (lower-casing and
    accent stripping on or off together, as BERT's), BertPreTokenizer, WordPiece with [UNK].
    Only the document text is encoded: no [CLS]/[SEP] is added, and "[SEP]" written in a
    document stays text, as Megatron's own BERT tokenizer treats it.

End of document: BPE and SentencePiece tokenizers have an EOD token, which the job appends to
each document for GPT data. A WordPiece vocabulary has none (Megatron's BERT tokenizer invents
ids past the vocabulary for it), and the datasets that read WordPiece data, megatron-core's
BERT and T5 datasets, take document boundaries from the .idx and add [CLS]/[SEP] or their
sentinels themselves: so nothing is appended for WordPiece unless --eod-token names a token.

For the two BPE formats the ids are defined as those of the `tokenizers` library with
add_special_tokens=False: document text only, no BOS or post-processor template, because
the job appends the end-of-document token itself. gigatoken encodes the same ids many times
faster, so it is used whenever it is importable, loads the tokenizer, and agrees with
`tokenizers` on a varied probe corpus (`PROBE_TEXTS`); otherwise `tokenizers` is used.

Loading the reference `tokenizers` model for that check costs about as much as loading
gigatoken (tens of milliseconds, in every job and every spawned worker), so a passed check is
remembered per tokenizer.json (`CheckCache`): keyed by the file's bytes, the EOD choice, the
probe texts and both engines' builds, so any change to one of them checks again.

Engines run single-threaded: the job's parallelism comes from worker processes, and a
thread pool per worker would only oversubscribe the cores (call `use_single_thread` before
the engines are imported).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from launcher_scripts.formats import long_documents
from launcher_scripts.formats.sentences import split_sentences

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
ENGINES = ("auto", "gigatoken", "tokenizers")

# Texts on which gigatoken must reproduce `tokenizers` exactly before it is trusted: the
# places byte-level BPE implementations tend to differ (pre-tokenizer regex on unicode
# classes, whitespace runs, digits, contractions, newlines, emoji, added special tokens).
PROBE_TEXTS: tuple[str, ...] = (
    "Hello, world! It's a test: don't, won't, I'm, we've, they'll, she'd.",
    "   leading spaces and trailing   ",
    "tabs\tand\t\ttabs\nnew\nlines\n\n\nand\r\nCRLF\r\n",
    "numbers 0 1 12 123 1234 12345 3.14159 -42 1e10 1,000,000 0x1F",
    "unicode: café naïve Zürich résumé Ελλάδα Москва 東京 北京大学 مرحبا שלום हिन्दी",
    "emoji 😀🚀👍🏽 👨‍👩‍👧‍👦 🇫🇷 and symbols — “quotes” ‘single’ € ± ß ∑ √ ∞",
    "special tokens in text <|endoftext|> </s> <eos> <|end_of_text|> <s> <pad> done",
    "<|endoftext|><|endoftext|>glued<|endoftext|>",
    "mixed CamelCaseWords and snake_case_words and URLs https://example.com/a?b=c&d=e#f",
    "    def f(x):\n        return x ** 2  # comment\n\n\n\tpass",
    "\u00a0non-breaking\u2009thin\u3000ideographic space\u200bzero-width\ufeffbom",
    "repeated aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!!!!!!!!!!!!???........",
    "",
    " ",
    "\n",
)


class TokenizerError(Exception):
    """A tokenizer that cannot be loaded or used, with a message fit for the user."""


def use_single_thread() -> None:
    """One encoding thread per process; must run before the Rust engines start."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


class Engine(Protocol):
    name: str

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def encode_documents(
        self, texts: list[str], dtype: type[np.number], eod: int | None
    ) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64]]: ...


def _groups(pieces: list[str], chars: int) -> Iterator[list[str]]:
    """Consecutive pieces in groups of about `chars` characters: one engine call each."""
    group: list[str] = []
    size = 0
    for piece in pieces:
        group.append(piece)
        size += len(piece)
        if size >= chars:
            yield group
            group, size = [], 0
    if group:
        yield group


def _pack_lists(
    ids: Sequence[Sequence[int]], dtype: type[np.number], eod: int | None
) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64]]:
    """Flat tokens and lengths of the non-empty documents, each followed by `eod`."""
    kept = [doc for doc in ids if len(doc)]
    suffix = [] if eod is None else [eod]
    lengths = np.fromiter((len(doc) + len(suffix) for doc in kept), np.int64, len(kept))
    pieces = chain.from_iterable((doc, suffix) for doc in kept)
    flat = np.fromiter(chain.from_iterable(pieces), dtype, int(lengths.sum()))
    return flat, lengths


class SentencePieceEngine:
    name = "sentencepiece"

    def __init__(self, processor: Any) -> None:
        self.processor = processor

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.processor.encode(texts, out_type=int, num_threads=1)

    def splits_at_spaces(self) -> bool:
        """Whether no piece spans a space (the trainer's split_by_whitespace, its default):
        what cutting a long document at spaces needs, beyond what the probe texts show."""
        try:
            from sentencepiece import sentencepiece_model_pb2
        except ImportError:  # protobuf absent: the probe texts alone decide
            return True
        model = sentencepiece_model_pb2.ModelProto()
        model.ParseFromString(self.processor.serialized_model_proto())
        return bool(model.trainer_spec.split_by_whitespace)

    def encode_documents(
        self, texts: list[str], dtype: type[np.number], eod: int | None
    ) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64]]:
        return _pack_lists(self.encode_batch(texts), dtype, eod)


class TokenizersEngine:
    name = "tokenizers"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def encode_documents(
        self, texts: list[str], dtype: type[np.number], eod: int | None
    ) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64]]:
        return _pack_lists(self.encode_batch(texts), dtype, eod)


class GigatokenEngine:
    """gigatoken's Rust BPE, one document per call.

    Its per-document `encode` returns a numpy array. Its batch calls return awkward arrays:
    importing awkward costs ~0.13 s per process, and with the job's 1 MB batches (plus the
    EOD insertion they then need) they measured no faster than one call per document.
    """

    name = "gigatoken"

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        encode = self.backend.encode
        return [encode(text).tolist() for text in texts]

    def encode_documents(
        self, texts: list[str], dtype: type[np.number], eod: int | None
    ) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64]]:
        encode = self.backend.encode
        suffix = np.array([] if eod is None else [eod], dtype=np.uint32)
        pieces: list[npt.NDArray[np.uint32]] = []
        lengths: list[int] = []
        for text in texts:
            ids = encode(text)
            if ids.size:
                pieces.append(ids)
                pieces.append(suffix)
                lengths.append(ids.size + suffix.size)
        if not pieces:
            return np.zeros(0, dtype), np.zeros(0, np.int64)
        # One copy that also narrows uint32 to the file dtype; ids are below vocab_size,
        # which fits the dtype by construction (token_dtype).
        flat = np.concatenate(pieces, dtype=dtype, casting="unsafe")
        return flat, np.array(lengths, dtype=np.int64)


@dataclass(frozen=True)
class TokenizerSpec:
    """How to load a tokenizer; small and picklable, for worker processes."""

    model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    eod_token: str | None = None
    engine: str = "auto"
    lower_case: bool = False  # WordPiece only: BertWordPieceLowerCase


@dataclass
class DocumentTokenizer:
    """A loaded tokenizer: the engine that encodes, the vocabulary size and the EOD id."""

    engine: Engine
    vocab_size: int
    eod_id: int | None  # None: the tokenizer has no end-of-document token to append
    source: str
    note: str = ""  # how the engine was chosen, when worth telling

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.engine.encode_batch(texts)

    def encode_documents(
        self,
        texts: list[str],
        dtype: type[np.number],
        append_eod: bool = True,
        progress: Callable[[int, int], None] | None = None,
    ) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64]]:
        """Flat token ids and per-document lengths for a batch, ready for the .bin.

        Documents that encode to no tokens are dropped (the caller counts them as empty):
        an EOD-only sequence would carry no text, only a spurious document boundary.
        A document longer than long_documents.LONG_CHARS is encoded in pieces, with
        `progress(characters encoded, characters in the batch)` after each engine call.
        """
        eod = self.eod_id if append_eod else None
        if all(len(text) <= long_documents.LONG_CHARS for text in texts):
            return self.engine.encode_documents(texts, dtype, eod)
        pieces, counts = long_documents.pieces_of(texts, self.cut_style())
        total = sum(len(piece) for piece in pieces)
        encoded: list[list[int]] = []
        done = 0
        for group in _groups(pieces, long_documents.CALL_CHARS):
            encoded += self.engine.encode_batch(group)
            done += sum(len(piece) for piece in group)
            if progress is not None:
                progress(done, total)
        documents: list[list[int]] = []
        for count in counts:
            documents.append(list(chain.from_iterable(encoded[:count])))
            del encoded[:count]
        return _pack_lists(documents, dtype, eod)

    def cut_style(self) -> str | None:
        """How a long document may be cut without changing its ids (long_documents.py)."""
        if not hasattr(self, "_cut_style"):
            splits = getattr(self.engine, "splits_at_spaces", lambda: True)()
            self._cut_style = long_documents.cut_style(self.engine.encode_batch) if splits else None
        return self._cut_style

    def encode_sentences(
        self, texts: list[str], dtype: type[np.number], append_eod: bool = True
    ) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Flat token ids, per-sentence lengths and sentences per document, for a batch split
        into sentences (sentences.split_sentences): one sequence per sentence.

        Sentences that encode to no tokens are dropped, and documents left with none; the
        EOD, when appended, ends a document's last sentence (as Megatron's preprocessing does).
        """
        split = [split_sentences(text) for text in texts]
        encoded = iter(self.engine.encode_batch([s for sentences in split for s in sentences]))
        eod = self.eod_id if append_eod else None
        sentences: list[list[int]] = []
        per_document: list[int] = []
        for document in split:
            kept = [ids for ids in (next(encoded) for _ in document) if len(ids)]
            if not kept:
                continue
            if eod is not None:
                kept[-1] = [*kept[-1], eod]
            sentences.extend(kept)
            per_document.append(len(kept))
        flat, lengths = _pack_lists(sentences, dtype, None)
        return flat, lengths, np.array(per_document, dtype=np.int64)

    def describe(self) -> str:
        note = f"; {self.note}" if self.note else ""
        eod = "none appended" if self.eod_id is None else self.eod_id
        return (
            f"{self.source} (engine {self.engine.name}, vocab {self.vocab_size}, eod {eod}{note})"
        )


def load_tokenizer(spec: TokenizerSpec) -> DocumentTokenizer:
    """Load the tokenizer `spec` names; TokenizerError with a clear message on failure."""
    if spec.engine not in ENGINES:
        raise TokenizerError(f"unknown engine {spec.engine!r}: choose one of {', '.join(ENGINES)}")
    if spec.model and (spec.vocab_file or spec.merge_file):
        raise TokenizerError("give --tokenizer-model or --vocab-file/--merge-file, not both")
    if spec.lower_case and not (spec.vocab_file and not spec.merge_file):
        raise TokenizerError(
            "--lower-case applies only to a WordPiece vocab.txt (--vocab-file without --merge-file)"
        )
    if spec.model:
        path = _existing(spec.model, "--tokenizer-model")
        if path.suffix == ".json":
            return _load_hf_json(path, spec)
        return _load_sentencepiece(path, spec)
    if spec.merge_file:
        if not spec.vocab_file:
            raise TokenizerError("GPT-2 BPE needs both --vocab-file and --merge-file")
        return _load_gpt2(spec)
    if spec.vocab_file:
        return _load_wordpiece(spec)
    raise TokenizerError(
        "no tokenizer: give --tokenizer-model, --vocab-file and --merge-file (GPT-2 BPE), "
        "or --vocab-file alone (WordPiece vocab.txt)"
    )


def _existing(path: str, flag: str) -> Path:
    resolved = Path(path)
    if not resolved.is_file():
        raise TokenizerError(f"{flag} {path}: no such file")
    return resolved


def _load_sentencepiece(path: Path, spec: TokenizerSpec) -> DocumentTokenizer:
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.Load(str(path))
    except (OSError, RuntimeError) as error:
        raise TokenizerError(f"{path}: not a SentencePiece model ({error})") from None
    if spec.eod_token is not None:
        eod = processor.piece_to_id(spec.eod_token)
        if processor.id_to_piece(eod) != spec.eod_token:  # unknown pieces map to unk
            raise TokenizerError(f"--eod-token {spec.eod_token!r} is not in {path}")
    else:
        eod = processor.eos_id()
        if eod < 0:
            raise TokenizerError(f"{path} has no eos piece: name one with --eod-token")
    return DocumentTokenizer(
        SentencePieceEngine(processor), processor.get_piece_size(), eod, str(path)
    )


def _load_hf_json(path: Path, spec: TokenizerSpec) -> DocumentTokenizer:
    raw = path.read_bytes()
    cache = CheckCache.for_file(raw, spec) if spec.engine != "tokenizers" else None
    remembered = cache.load(raw, str(path)) if cache else None
    if remembered is not None:
        return remembered
    import tokenizers

    try:
        data = raw.decode("utf-8")
        reference = tokenizers.Tokenizer.from_str(data)
    except Exception as error:  # the Rust loader raises plain Exception subclasses
        raise TokenizerError(f"{path}: not a Hugging Face tokenizer.json ({error})") from None
    tokenizer = _hf_document_tokenizer(reference, data, spec, str(path))
    if cache and tokenizer.engine.name == "gigatoken":
        cache.store(tokenizer)
    return tokenizer


def _load_gpt2(spec: TokenizerSpec) -> DocumentTokenizer:
    reference = gpt2_reference(spec.vocab_file or "", spec.merge_file or "", spec.eod_token)
    source = f"{spec.vocab_file} + {spec.merge_file}"
    return _hf_document_tokenizer(reference, reference.to_str(), spec, source)


def _load_wordpiece(spec: TokenizerSpec) -> DocumentTokenizer:
    reference = wordpiece_reference(spec.vocab_file or "", spec.lower_case)
    eod = None
    if spec.eod_token is not None:
        eod = reference.token_to_id(spec.eod_token)
        if eod is None:
            raise TokenizerError(
                f"--eod-token {spec.eod_token!r} is not in the vocabulary of {spec.vocab_file}"
            )
    case = "lower-cased" if spec.lower_case else "cased"
    return DocumentTokenizer(
        TokenizersEngine(reference),
        reference.get_vocab_size(with_added_tokens=True),
        eod,
        f"{spec.vocab_file} (WordPiece, {case})",
    )


def wordpiece_reference(vocab_file: str, lower_case: bool) -> Any:
    """BERT's WordPiece tokenizer for a vocab.txt, encoding text only (no [CLS]/[SEP])."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    path = _existing(vocab_file, "--vocab-file")
    with open(path, "rb") as stream:
        if stream.read(4096).lstrip().startswith(b"{"):
            raise TokenizerError(
                f"--vocab-file {path} is a JSON vocabulary (GPT-2 BPE): give its merges.txt "
                "with --merge-file, or a WordPiece vocab.txt"
            )
    try:
        vocab = models.WordPiece.read_file(str(path))
    except Exception as error:  # the Rust reader raises plain Exception subclasses
        raise TokenizerError(f"{path}: not a WordPiece vocab.txt ({error})") from None
    if "[UNK]" not in vocab:
        raise TokenizerError(f"{path} has no [UNK] token: it is not a BERT WordPiece vocab.txt")
    reference = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    # strip_accents=None follows lowercase, as BERT's BasicTokenizer does.
    reference.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lower_case
    )
    reference.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    reference.decoder = decoders.WordPiece(prefix="##")
    return reference


def gpt2_reference(vocab_file: str, merge_file: str, eod_token: str | None = None) -> Any:
    """GPT-2's byte-level BPE exactly as its Hugging Face tokenizer.json defines it."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors

    vocab = _existing(vocab_file, "--vocab-file")
    merges = _existing(merge_file, "--merge-file")
    try:
        model = models.BPE.from_file(str(vocab), str(merges))
    except Exception as error:
        raise TokenizerError(
            f"{vocab} / {merges}: not a GPT-2 vocab and merges ({error})"
        ) from None
    reference = tokenizers.Tokenizer(model)
    reference.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    reference.decoder = decoders.ByteLevel()
    reference.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [token for token in (*EOD_CANDIDATES, eod_token) if token]
    present = [token for token in dict.fromkeys(specials) if model.token_to_id(token) is not None]
    reference.add_special_tokens([tokenizers.AddedToken(token, special=True) for token in present])
    return reference


def _hf_document_tokenizer(
    reference: Any, data: str, spec: TokenizerSpec, source: str
) -> DocumentTokenizer:
    eod = resolve_eod(reference, spec.eod_token, source)
    vocab_size = reference.get_vocab_size(with_added_tokens=True)
    engine: Engine = TokenizersEngine(reference)
    if spec.engine != "tokenizers":
        fast, why_not = _gigatoken_engine(data, reference)
        if fast is not None:
            engine = fast
            vocab_size = max(vocab_size, fast.backend.vocab_size)
        elif spec.engine == "gigatoken":
            raise TokenizerError(f"{source}: gigatoken cannot be used: {why_not}")
        else:
            print(f"note: {source}: using tokenizers, not gigatoken: {why_not}", file=sys.stderr)
    return DocumentTokenizer(engine, vocab_size, eod, source)


def resolve_eod(reference: Any, eod_token: str | None, source: str) -> int:
    """The end-of-document id: --eod-token when given, else the first known EOD token."""
    candidates = (eod_token,) if eod_token is not None else EOD_CANDIDATES
    for token in candidates:
        token_id = reference.token_to_id(token)
        if token_id is not None:
            return int(token_id)
    if eod_token is not None:
        raise TokenizerError(f"--eod-token {eod_token!r} is not in the vocabulary of {source}")
    raise TokenizerError(
        f"{source} has none of the end-of-document tokens {', '.join(EOD_CANDIDATES)}: "
        "name one with --eod-token"
    )


def _gigatoken_engine(data: str, reference: Any) -> tuple[GigatokenEngine | None, str]:
    """gigatoken for this tokenizer.json when it matches `tokenizers` on PROBE_TEXTS."""
    try:
        import gigatoken
    except ImportError:
        return None, "gigatoken is not installed"
    try:
        engine = GigatokenEngine(gigatoken.Tokenizer.from_json(data).backend)
    except Exception as error:  # unsupported tokenizer configurations raise from Rust
        return None, f"it does not load this tokenizer ({error})"
    expected = TokenizersEngine(reference).encode_batch(list(PROBE_TEXTS))
    if engine.encode_batch(list(PROBE_TEXTS)) != expected:
        return None, "its ids differ from tokenizers' on the probe texts"
    return engine, ""


@dataclass(frozen=True)
class CheckCache:
    """A passed gigatoken-vs-tokenizers check of one tokenizer.json, remembered on disk with
    the EOD id and vocabulary size it found, so a later load needs gigatoken alone.

    Lives in $XDG_CACHE_HOME/llm-launcher/gigatoken-checks (default ~/.cache). Only passed
    checks are stored: a failed one needs the reference loaded anyway, to encode with it.
    A cache that cannot be read or written (read-only home) is silently skipped.
    """

    path: Path

    VERSION = 1

    @classmethod
    def for_file(cls, raw: bytes, spec: TokenizerSpec) -> CheckCache | None:
        try:
            import gigatoken.gigatoken_rs as rust
            import tokenizers

            build = os.stat(rust.__file__)
        except (ImportError, OSError, AttributeError):
            return None  # no gigatoken: nothing to remember
        digest = hashlib.sha256()
        # Everything the check's outcome depends on; gigatoken has no __version__, so its
        # compiled module's identity stands for its build.
        parts = (cls.VERSION, spec.eod_token, tokenizers.__version__, rust.__file__,
                 build.st_size, build.st_mtime_ns, PROBE_TEXTS)  # fmt: skip
        digest.update(repr(parts).encode("utf-8"))
        digest.update(raw)
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return cls(Path(base, "llm-launcher", "gigatoken-checks", f"{digest.hexdigest()}.json"))

    def load(self, raw: bytes, source: str) -> DocumentTokenizer | None:
        """The tokenizer on gigatoken alone when this file passed before, else None."""
        try:
            entry = json.loads(self.path.read_text(encoding="utf-8"))
            vocab_size, eod = int(entry["vocab_size"]), int(entry["eod_id"])
            import gigatoken

            engine = GigatokenEngine(gigatoken.Tokenizer.from_json(raw).backend)
        except Exception:  # no entry, or an unreadable one: check again
            return None
        note = "identical to tokenizers by a remembered check"
        return DocumentTokenizer(engine, vocab_size, eod, source, note)

    def store(self, tokenizer: DocumentTokenizer) -> None:
        entry = {"vocab_size": tokenizer.vocab_size, "eod_id": tokenizer.eod_id}
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(entry), encoding="utf-8")
            os.replace(tmp, self.path)  # whole or absent, even with many tasks writing
        except OSError:
            with contextlib.suppress(OSError):  # e.g. the folder could not be made
                tmp.unlink(missing_ok=True)


def trained_tokenizer_file(model_prefix: str, model_type: str) -> Path:
    """What the tokenizer-training job leaves: NAME.model (SentencePiece), or NAME.vocab.txt
    (a BERT WordPiece vocabulary, model type `wordpiece`)."""
    suffix = ".vocab.txt" if model_type == "wordpiece" else ".model"
    return Path(f"{model_prefix}{suffix}")
