"""The data-preparation job programs: tokenizing into Megatron indexed datasets, and training
a SentencePiece tokenizer. Corpora and tokenizers are generated here; nothing is downloaded."""

from __future__ import annotations

import gzip
import io
import json
import random
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import sentencepiece
import tokenizers
from tokenizers import Tokenizer

from launcher_scripts.formats import indexed_writer
from launcher_scripts.formats.sentences import split_sentences
from launcher_scripts.formats.tokenizer import (
    PROBE_TEXTS,
    TokenizerError,
    TokenizerSpec,
    load_tokenizer,
)
from launcher_scripts.jobs.data_prep import preprocess, readers
from tests.support import wordpiece_corpus
from tests.support.data_prep_corpus import (
    EOD,
    run_job,
    save_tokenizer_files,
    train_byte_level_bpe,
    tricky_jsonl_lines,
    varied_texts,
    write_jsonl,
    write_text_dir,
)

RANK_VARIABLES = (
    "SLURM_ARRAY_TASK_ID",
    "SLURM_ARRAY_TASK_COUNT",
    "NGC_ARRAY_INDEX",
    "NGC_ARRAY_SIZE",
    "RANK",
    "WORLD_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
)


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return varied_texts(400, seed=1)


@pytest.fixture(scope="module")
def bpe(corpus: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    tokenizer = train_byte_level_bpe(corpus)
    tokenizer_json, vocab, merges = save_tokenizer_files(tokenizer, tmp_path_factory.mktemp("bpe"))
    return {"tokenizer": tokenizer, "json": tokenizer_json, "vocab": vocab, "merges": merges}


@pytest.fixture(autouse=True)
def single_task(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def private_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Each test remembers tokenizer checks in its own folder, not in the user's cache."""
    cache = tmp_path / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    return cache


@pytest.fixture
def small_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut JSONL inputs into many byte ranges even at test sizes (workers are forked, so they
    see the patched values)."""
    monkeypatch.setattr(preprocess, "MIN_RANGE_BYTES", 2048)
    monkeypatch.setattr(preprocess, "MAX_RANGE_BYTES", 8192)


def expected_ids(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """What the shard must hold: each non-empty document's ids plus the EOD."""
    eod = tokenizer.token_to_id(EOD)
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    return [enc.ids + [eod] for enc in encoded if enc.ids]


def read_shard(prefix: Path) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    return [dataset[index].tolist() for index in range(len(dataset))]


def preprocess_main(*args: str | Path) -> int:
    return preprocess.main([str(arg) for arg in args])


# ---- indexed dataset format --------------------------------------------------------------


def test_writer_and_merge_are_read_by_megatron(tmp_path: Path) -> None:
    parts = [
        [[5, 6, 7], [1]],
        [[9] * 10],
        [[2, 3], [4, 4, 4, 4], [65535, 0]],
    ]
    for number, docs in enumerate(parts):
        indexed_writer.write_dataset(tmp_path / f"part{number}", docs, np.uint16)
    merged = indexed_writer.merge_datasets(
        [tmp_path / f"part{number}" for number in range(3)], tmp_path / "all"
    )
    assert merged.document_indices.tolist() == list(range(7))
    assert read_shard(tmp_path / "all") == [doc for docs in parts for doc in docs]
    assert indexed_writer.is_complete(tmp_path / "all")
    # A truncated .bin makes the dataset incomplete.
    bin_file = tmp_path / "all.bin"
    bin_file.write_bytes(bin_file.read_bytes()[:-2])
    assert not indexed_writer.is_complete(tmp_path / "all")
    assert not list(tmp_path.glob(".*tmp*"))


def test_token_dtype_follows_megatron() -> None:
    assert indexed_writer.token_dtype(32000) is np.uint16
    assert indexed_writer.token_dtype(65499) is np.uint16
    assert indexed_writer.token_dtype(65500) is np.int32
    assert indexed_writer.DTYPE_CODES[np.uint16] == 8
    assert indexed_writer.DTYPE_CODES[np.int32] == 4


# ---- readers -----------------------------------------------------------------------------


def test_byte_ranges_tile_a_jsonl_file(tmp_path: Path) -> None:
    texts = varied_texts(300, seed=3)
    path = write_jsonl(tmp_path / "data.jsonl", texts)
    size = path.stat().st_size
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted({0, size, *(rng.randrange(size + 1) for _ in range(rng.randint(1, 8)))})
        seen: list[str] = []
        for start, end in zip(cuts, cuts[1:], strict=False):
            stats = readers.ReadStats()
            for batch in readers.iter_jsonl_range(path, start, end, "text", stats, 512):
                seen.extend(batch)
        assert seen == texts


def per_line_reference(
    data: bytes, path: str, text_key: str = "text"
) -> tuple[list[str], readers.ReadStats]:
    """What reading JSON lines means, one line at a time: each non-blank line is a record,
    an object as orjson parses it with a string under `text_key`, or else a bad record."""
    stats = readers.ReadStats(bytes_read=len(data))
    texts = []
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    for number, line in enumerate(lines, 1):
        stats.lines += 1
        if not line.strip():
            continue
        stats.records += 1
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            stats.add_bad(path, number, "not valid JSON")
            continue
        text = obj.get(text_key) if isinstance(obj, dict) else None
        if isinstance(text, str):
            texts.append(text)
        elif not isinstance(obj, dict):
            stats.add_bad(path, number, "not a JSON object")
        elif text is None:
            stats.add_bad(path, number, f"key {text_key!r} missing")
        else:
            stats.add_bad(path, number, f"{text_key!r} not a string")
    return texts, stats


def read_jsonl_bytes(data: bytes, chunk_bytes: int) -> tuple[list[str], readers.ReadStats]:
    stats = readers.ReadStats()
    stream = io.BytesIO(data)
    batches = readers.iter_jsonl_stream(stream, "x.jsonl", "text", stats, None, chunk_bytes)
    return [text for batch in batches for text in batch], stats


def mutate(line: bytes, rng: random.Random) -> bytes:
    """A line with a few bytes replaced, inserted or deleted: bytes that matter to JSON,
    to UTF-8 and to line splitting."""
    data = bytearray(line)
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(data) + 1)
        byte = rng.choice(b'"\\{}[]:,\n\r \x00\x01\x7f\x80\xc3\xed\xffu0d8e9')
        operation = rng.randrange(3)
        if operation == 0 and at < len(data):
            data[at] = byte
        elif operation == 1:
            data.insert(at, byte)
        elif at < len(data):
            del data[at]
    return bytes(data)


def test_jsonl_reader_matches_the_per_line_definition(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunked reader parses lines in place from a reused buffer; whatever the chunk size,
    its texts, counts and bad records (all of them, with line numbers) are the per-line ones."""
    monkeypatch.setattr(readers, "MAX_REPORTED_BAD", 1_000_000)
    rng = random.Random(11)
    lines = tricky_jsonl_lines()
    fuzzed = [mutate(line, rng) if rng.random() < 0.5 else line for line in lines * 4]
    for data in (
        b"\n".join(lines) + b"\n",
        b"\n".join(lines),  # no newline at the end
        b"\n".join(lines) + b"\n\n\n",
        b"\r\n".join(lines),
        b"\n".join(fuzzed),
    ):
        expected_texts, expected = per_line_reference(data, "x.jsonl")
        assert expected.bad and expected_texts
        for chunk_bytes in (1, 7, 100, 4096, 1 << 20):
            texts, stats = read_jsonl_bytes(data, chunk_bytes)
            assert texts == expected_texts, chunk_bytes
            assert stats == expected, chunk_bytes


def test_jsonl_byte_ranges_count_bad_lines_like_one_read(tmp_path: Path) -> None:
    path = tmp_path / "tricky.jsonl"
    path.write_bytes(b"\n".join(tricky_jsonl_lines(seed=2) * 3) + b"\n")
    expected_texts, expected = per_line_reference(path.read_bytes(), str(path))
    size = path.stat().st_size
    rng = random.Random(5)
    for _ in range(10):
        cuts = sorted({0, size, *(rng.randrange(size + 1) for _ in range(rng.randint(1, 6)))})
        texts: list[str] = []
        merged = readers.ReadStats()
        for start, end in zip(cuts, cuts[1:], strict=False):
            stats = readers.ReadStats()
            for batch in readers.iter_jsonl_range(path, start, end, "text", stats, 300):
                texts.extend(batch)
            merged.merge(stats, line_offset=merged.lines)
        assert texts == expected_texts
        assert merged == expected


def test_json_array_gz_and_text_directory_readers(tmp_path: Path) -> None:
    texts = ["first doc", "second\ndoc", "😀 third"]
    array = tmp_path / "array.json"
    array.write_text(json.dumps([{"text": t} for t in texts] + [{"x": 1}]), encoding="utf-8")
    stats = readers.ReadStats()
    assert list(readers.iter_documents(array, "text", stats)) == texts
    assert (stats.records, stats.bad) == (4, 1)
    assert str(stats.bad_examples[0]).startswith(f"{array}:4:")

    gz = write_jsonl(tmp_path / "docs.jsonl.gz", texts, key="content")
    assert list(readers.iter_documents(gz, "content", readers.ReadStats())) == texts

    folder = tmp_path / "texts"
    files = write_text_dir(folder, texts)
    (folder / ".hidden").write_text("not a document")
    assert list(readers.iter_documents(folder, "text", readers.ReadStats())) == [
        f.read_bytes().decode("utf-8") for f in files
    ]
    assert readers.dataset_stem(gz) == "docs"
    assert readers.dataset_stem(folder) == "texts"
    assert readers.dataset_stem(tmp_path / "a.b.JSON.GZ") == "a.b"


# ---- tokenizers --------------------------------------------------------------------------


def test_gigatoken_ids_are_identical_to_tokenizers(corpus: list[str], bpe: dict) -> None:
    texts = [*corpus, *PROBE_TEXTS, "x" * 5000, " " * 300, "\n".join(corpus[:50])]
    for spec in (
        TokenizerSpec(model=str(bpe["json"])),
        TokenizerSpec(vocab_file=str(bpe["vocab"]), merge_file=str(bpe["merges"])),
    ):
        fast = load_tokenizer(TokenizerSpec(**{**spec.__dict__, "engine": "gigatoken"}))
        reference = load_tokenizer(TokenizerSpec(**{**spec.__dict__, "engine": "tokenizers"}))
        assert fast.engine.name == "gigatoken"
        assert load_tokenizer(spec).engine.name == "gigatoken"  # auto prefers it
        assert fast.encode_batch(texts) == reference.encode_batch(texts)
        assert (fast.eod_id, fast.vocab_size) == (reference.eod_id, reference.vocab_size)
        expected = [
            enc.ids for enc in bpe["tokenizer"].encode_batch(texts, add_special_tokens=False)
        ]
        assert fast.encode_batch(texts) == expected
        # The special token in text is one id, as Hugging Face's GPT-2 tokenizer makes it.
        assert fast.encode_batch([EOD]) == [[fast.eod_id]]
        flat, lengths = fast.encode_documents(texts, np.uint16)
        nonempty = [ids + [fast.eod_id] for ids in expected if ids]
        assert lengths.tolist() == [len(ids) for ids in nonempty]
        assert flat.tolist() == [token for ids in nonempty for token in ids]


LONG_DOCUMENT_TOKENIZERS = ("sentencepiece", "gigatoken", "tokenizers", "gpt2 files", "wordpiece")


def long_document_tokenizer(kind: str, corpus: list[str], bpe: dict, folder: Path) -> Any:
    """A tokenizer of each kind the job loads."""
    if kind == "sentencepiece":
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(corpus), model_prefix=str(folder / "sp"), vocab_size=600,
            character_coverage=1.0, model_type="bpe", minloglevel=2,
        )  # fmt: skip
        return load_tokenizer(TokenizerSpec(model=str(folder / "sp.model")))
    if kind in ("gigatoken", "tokenizers"):
        return load_tokenizer(TokenizerSpec(model=str(bpe["json"]), engine=kind))
    if kind == "gpt2 files":
        return load_tokenizer(
            TokenizerSpec(vocab_file=str(bpe["vocab"]), merge_file=str(bpe["merges"]))
        )
    vocab = wordpiece_corpus.write_vocab(folder / "vocab.txt", cased=True)
    return load_tokenizer(TokenizerSpec(vocab_file=str(vocab)))


@pytest.mark.parametrize("kind", LONG_DOCUMENT_TOKENIZERS)
def test_a_long_document_reaches_the_engine_in_bounded_pieces_with_the_same_ids(
    kind: str, corpus: list[str], bpe: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 50 MB one-line document was one engine call: a tenth of the usual speed per byte,
    and no progress (an ETA of 90,000 hours) until it returned."""
    from launcher_scripts.formats import long_documents

    monkeypatch.setattr(long_documents, "CALL_CHARS", 1 << 16)  # progress in a small document
    long = " ".join(corpus * 8)
    assert len(long) > max(long_documents.LONG_CHARS, 4 * long_documents.CALL_CHARS)
    texts = [corpus[0], long, corpus[1]]
    tokenizer = long_document_tokenizer(kind, corpus, bpe, tmp_path)
    whole = tokenizer.engine.encode_batch(texts)
    calls: list[list[int]] = []
    encode = tokenizer.engine.encode_batch

    def recorded(batch: list[str]) -> list[list[int]]:
        calls.append([len(text) for text in batch])
        return encode(batch)

    tokenizer.engine.encode_batch = recorded
    reports: list[tuple[int, int]] = []
    flat, lengths = tokenizer.encode_documents(
        texts, np.uint32, progress=lambda done, total: reports.append((done, total))
    )
    eod = [] if tokenizer.eod_id is None else [tokenizer.eod_id]
    assert flat.tolist() == [token for ids in whole for token in [*ids, *eod]]
    assert lengths.tolist() == [len(ids) + len(eod) for ids in whole]
    encoded = [length for call in calls for length in call]
    assert max(encoded) <= long_documents.PIECE_CHARS + 1  # the probe's calls are short too
    assert sum(encoded) >= len(long)
    # Progress comes piece by piece, up to the whole batch.
    assert len(reports) > 4 and reports[-1][0] == reports[-1][1]
    assert [done for done, _ in reports] == sorted({done for done, _ in reports})


def test_a_tokenizer_whose_pieces_span_spaces_gets_long_documents_whole(
    corpus: list[str], tmp_path: Path
) -> None:
    """Cutting at spaces would change the ids of a SentencePiece model trained with
    split_by_whitespace=false, whatever the probe texts show."""
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=600,
        character_coverage=1.0, model_type="bpe", split_by_whitespace=False, minloglevel=2,
    )  # fmt: skip
    tokenizer = load_tokenizer(TokenizerSpec(model=str(tmp_path / "sp.model")))
    assert tokenizer.cut_style() is None
    long = " ".join(corpus * 2)
    flat, _lengths = tokenizer.encode_documents([long], np.uint32, append_eod=False)
    assert flat.tolist() == tokenizer.encode_batch([long])[0]


def test_gigatoken_check_is_remembered(
    corpus: list[str], bpe: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = TokenizerSpec(model=str(bpe["json"]))
    first = load_tokenizer(spec)
    assert first.engine.name == "gigatoken" and first.note == ""

    # A remembered check needs no reference tokenizer: make loading one fail.
    class NoReference:
        @staticmethod
        def from_str(data: str) -> None:
            raise RuntimeError("the reference tokenizer was loaded")

    fake = types.SimpleNamespace(__version__=tokenizers.__version__, Tokenizer=NoReference)
    monkeypatch.setitem(sys.modules, "tokenizers", fake)
    again = load_tokenizer(spec)
    assert again.engine.name == "gigatoken" and "remembered" in again.note
    assert (again.eod_id, again.vocab_size) == (first.eod_id, first.vocab_size)
    assert again.encode_batch(corpus) == first.encode_batch(corpus)
    # What the check depends on is in its key: another EOD choice or other bytes check again.
    with pytest.raises(TokenizerError, match="the reference tokenizer was loaded"):
        load_tokenizer(TokenizerSpec(model=str(bpe["json"]), eod_token="the"))
    changed = tmp_path / "tokenizer.json"
    changed.write_text(json.dumps(json.loads(bpe["json"].read_text())), encoding="utf-8")
    with pytest.raises(TokenizerError, match="the reference tokenizer was loaded"):
        load_tokenizer(TokenizerSpec(model=str(changed)))
    # The tokenizers engine asked for by name is loaded as always.
    with pytest.raises(TokenizerError, match="the reference tokenizer was loaded"):
        load_tokenizer(TokenizerSpec(model=str(bpe["json"]), engine="tokenizers"))


def test_unwritable_check_cache_is_skipped(
    bpe: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    for _ in range(2):
        tokenizer = load_tokenizer(TokenizerSpec(model=str(bpe["json"])))
        assert tokenizer.engine.name == "gigatoken" and tokenizer.note == ""


def test_eod_resolution(bpe: dict, tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_file(str(bpe["json"]))
    assert load_tokenizer(TokenizerSpec(model=str(bpe["json"]))).eod_id == tokenizer.token_to_id(
        EOD
    )
    data = json.loads(bpe["json"].read_text(encoding="utf-8"))
    data["added_tokens"] = []
    data["model"]["vocab"].pop(EOD)
    plain = tmp_path / "tokenizer.json"
    plain.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"<\|endoftext\|>, </s>, <eos>, <\|end_of_text\|>"):
        load_tokenizer(TokenizerSpec(model=str(plain)))
    assert load_tokenizer(TokenizerSpec(model=str(plain), eod_token="the")).eod_id == (
        tokenizer.token_to_id("the")
    )
    with pytest.raises(TokenizerError, match="no such file"):
        load_tokenizer(TokenizerSpec(model=str(tmp_path / "missing.model")))


# ---- preprocess --------------------------------------------------------------------------


def test_preprocess_output_loads_in_megatron_with_eod(
    corpus: list[str], bpe: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    texts = [*corpus, "", "   ", corpus[0]]  # an empty document is skipped, whitespace is not
    write_jsonl(tmp_path / "in" / "web.jsonl", texts)
    out = tmp_path / "out"
    code = preprocess_main(
        "--input", tmp_path / "in" / "web.jsonl", "--output-dir", out,
        "--output-prefix", "gpt_", "--tokenizer-model", bpe["json"], "--workers", "2",
    )  # fmt: skip
    assert code == 0
    shard = read_shard(out / "gpt_web_text_document")
    assert shard == expected_ids(bpe["tokenizer"], texts)
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    tokens = sum(map(len, shard))
    assert f"{len(shard)} documents, {tokens} tokens" in summary
    assert "1 empty documents skipped" in summary and "MB/s" in summary and "tokens/s" in summary
    assert sorted(p.name for p in out.iterdir()) == [
        "gpt_web_text_document.bin",
        "gpt_web_text_document.idx",
        "gpt_web_text_document.meta.json",
    ]
    # The record holds what a training preflight checks against the tokenizer's size.
    stats = indexed_writer.read_stats(out / "gpt_web_text_document")
    assert stats is not None
    assert (stats["tokens"], stats["max_token_id"]) == (tokens, max(map(max, shard)))


def test_gpt_dataset_builds_over_the_output(corpus: list[str], bpe: dict, tmp_path: Path) -> None:
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    write_jsonl(tmp_path / "web.jsonl", corpus)
    code = preprocess_main(
        "--input", tmp_path / "web.jsonl", "--output-dir", tmp_path,
        "--vocab-file", bpe["vocab"], "--merge-file", bpe["merges"], "--workers", "2",
    )  # fmt: skip
    assert code == 0
    prefix = str(tmp_path / "web_text_document")
    eod = bpe["tokenizer"].token_to_id(EOD)

    class MegatronTokenizer:  # what GPTDataset reads from a tokenizer
        vocab_size = bpe["tokenizer"].get_vocab_size()
        eod = bpe["tokenizer"].token_to_id(EOD)
        pad = eod
        unique_identifiers = {"class": "MegatronTokenizer"}

    sequence_length = 32
    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=sequence_length,
        blend=([prefix], None),
        split="100,0,0",
        tokenizer=MegatronTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=True,
        path_to_cache=str(tmp_path / "cache"),
    )
    # torch.distributed is not initialised: the builder then builds on this process alone.
    train, valid, test = BlendedMegatronDatasetBuilder(
        GPTDataset, [50, None, None], lambda: True, config
    ).build()
    assert valid is None and test is None and len(train) >= 50
    indexed = IndexedDataset(prefix)
    # Sample i is a window of the documents concatenated in the dataset's shuffled order.
    stream = np.concatenate([indexed[int(doc)] for doc in train.document_index])
    starts = np.concatenate([[0], np.cumsum(indexed.sequence_lengths[train.document_index])])
    for index in range(5):
        sample = train[index]
        position, offset = train.sample_index[train.shuffle_index[index]]
        begin = starts[position] + offset
        window = stream[begin : begin + sequence_length + 1]
        assert sample["tokens"].tolist() == window[:-1].tolist()
        assert sample["labels"].tolist() == window[1:].tolist()
        assert (sample["loss_mask"][sample["tokens"] == eod] == 0).all()  # eod_mask_loss


def test_workers_give_byte_identical_output(
    corpus: list[str], bpe: dict, tmp_path: Path, small_ranges: None
) -> None:
    write_jsonl(tmp_path / "web.jsonl", corpus * 3)
    outputs = []
    for workers in (1, 2, 3):
        out = tmp_path / f"out{workers}"
        code = preprocess_main(
            "--input", tmp_path / "web.jsonl", "--output-dir", out,
            "--tokenizer-model", bpe["json"], "--workers", str(workers),
        )  # fmt: skip
        assert code == 0
        outputs.append(
            tuple((out / f"web_text_document{s}").read_bytes() for s in (".bin", ".idx"))
        )
    assert len(preprocess.plan_units(0, preprocess.Shard(tmp_path / "web.jsonl", tmp_path), 2)) > 2
    assert outputs[0] == outputs[1] == outputs[2]


def test_bad_lines_are_reported_with_file_and_line(
    bpe: dict, tmp_path: Path, small_ranges: None, capsys: pytest.CaptureFixture[str]
) -> None:
    good = [json.dumps({"text": f"document number {n} " * 20}) for n in range(400)]
    bad = {
        57: "not json at all",
        130: json.dumps(["a", "list"]),
        212: json.dumps({"body": "wrong key"}),
        300: '{"text": "a lone \\ud800 surrogate is not text"}',
        377: json.dumps({"text": 17}),
    }
    lines = [bad.get(number, line) for number, line in enumerate(good, 1)]
    path = tmp_path / "web.jsonl"
    path.write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    code = preprocess_main(
        "--input", path, "--output-dir", tmp_path / "out", "--tokenizer-model", bpe["json"],
        "--workers", "2", "--max-bad-fraction", "0.05",
    )  # fmt: skip
    assert code == 0
    err = capsys.readouterr().err
    assert f"{path}: 5 bad of 400 records" in err
    reasons = ("not valid JSON", "not a JSON object", "key 'text' missing", "not valid JSON")
    for number, reason in zip(bad, (*reasons, "'text' not a string"), strict=True):
        assert f"{path}:{number}: {reason}" in err
    assert len(read_shard(tmp_path / "out" / "web_text_document")) == 395


def test_tricky_lines_through_the_job(
    bpe: dict, tmp_path: Path, small_ranges: None, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tricky.jsonl"
    path.write_bytes(b"\n".join(tricky_jsonl_lines(seed=3) * 20) + b"\n")
    texts, stats = per_line_reference(path.read_bytes(), str(path))
    code = preprocess_main(
        "--input", path, "--output-dir", tmp_path / "out", "--tokenizer-model", bpe["json"],
        "--workers", "2", "--max-bad-fraction", "0.5",
    )  # fmt: skip
    assert code == 0
    assert f"{path}: {stats.bad} bad of {stats.records} records" in capsys.readouterr().err
    assert read_shard(tmp_path / "out" / "tricky_text_document") == expected_ids(
        bpe["tokenizer"], texts
    )


def test_too_many_bad_lines_fail_the_job_without_a_shard(bpe: dict, tmp_path: Path) -> None:
    path = tmp_path / "web.jsonl"
    path.write_text(
        "\n".join(["{not json"] * 12 + ['{"text": "fine text"}'] * 88) + "\n", encoding="utf-8"
    )
    more = [f'{{"text": "more {n}"}}' for n in range(20)]
    (tmp_path / "ok.jsonl").write_text("\n".join(more), encoding="utf-8")
    result = run_job(
        "preprocess", "--input", path, tmp_path / "ok.jsonl", "--output-dir", tmp_path / "out",
        "--tokenizer-model", bpe["json"], "--workers", "2",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{path}:1: not valid JSON" in result.stderr
    assert "... and 2 more bad records" in result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: too many bad records")
    assert "12 of 100 records (12.00%) are bad, more than --max-bad-fraction 0.01" in error
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "web_text_document.idx").exists()
    assert indexed_writer.is_complete(tmp_path / "out" / "ok_text_document")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "ok_text_document.bin",
        "ok_text_document.idx",
        "ok_text_document.meta.json",
    ]


def test_rerun_skips_complete_shards(
    corpus: list[str], bpe: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = [write_jsonl(tmp_path / f"part{n}.jsonl", corpus[n::3]) for n in range(3)]
    out = tmp_path / "out"
    args = ["--input", *inputs, "--output-dir", out, "--tokenizer-model", bpe["json"]]
    assert preprocess_main(*args, "--workers", "2") == 0
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    (out / "part1_text_document.idx").unlink()  # as if the run had died before publishing it
    capsys.readouterr()
    assert preprocess_main(*args, "--workers", "2") == 0
    printed = capsys.readouterr().out
    assert "skip part0_text_document: already complete" in printed
    assert "skip part2_text_document: already complete" in printed
    assert "1 written, 2 already complete" in printed
    for name in ("part0_text_document.bin", "part2_text_document.idx"):
        assert (out / name).stat().st_mtime_ns == stamps[name]
    assert read_shard(out / "part1_text_document") == expected_ids(bpe["tokenizer"], corpus[1::3])


def mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


def test_rerun_redoes_the_shards_whose_tokenizer_inputs_or_settings_changed(
    corpus: list[str], bpe: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = [write_jsonl(tmp_path / f"part{n}.jsonl", corpus[n::3]) for n in range(3)]
    out = tmp_path / "out"
    names = [f"part{n}_text_document" for n in range(3)]

    def run(*tokenizer: str | Path, extra: tuple[str, ...] = ()) -> str:
        capsys.readouterr()
        args = ["--input", *inputs, "--output-dir", out, *tokenizer, "--workers", "2", *extra]
        assert preprocess_main(*args) == 0
        return capsys.readouterr().out

    run("--tokenizer-model", bpe["json"])
    # Another tokenizer (a smaller vocabulary): every shard is redone with its ids.
    other = train_byte_level_bpe(corpus, vocab_size=500)
    other_json, other_vocab, other_merges = save_tokenizer_files(other, tmp_path / "other")
    printed = run("--tokenizer-model", other_json)
    assert all(f"tokenizer changed: redoing {name}" in printed for name in names), printed
    assert "3 written, 0 already complete" in printed
    for n, name in enumerate(names):
        assert read_shard(out / name) == expected_ids(other, corpus[n::3])
    # The same tokenizer at another path, or unchanged: nothing is redone.
    copy = tmp_path / "copy" / "tokenizer.json"
    copy.parent.mkdir()
    copy.write_bytes(other_json.read_bytes())
    before = mtimes(out)
    assert "0 written, 3 already complete" in run("--tokenizer-model", copy)
    assert mtimes(out) == before
    # One input changed: only its shard is redone.
    write_jsonl(inputs[1], corpus[:40])
    printed = run("--tokenizer-model", other_json)
    assert f"input {inputs[1]} changed: redoing part1_text_document" in printed
    assert "1 written, 2 already complete" in printed
    assert read_shard(out / names[1]) == expected_ids(other, corpus[:40])
    after = mtimes(out)
    assert all(after[f"{names[n]}.bin"] == before[f"{names[n]}.bin"] for n in (0, 2))
    # A setting that changes the output: every shard is redone.
    printed = run("--tokenizer-model", other_json, extra=("--no-append-eod",))
    assert "settings changed (append_eod True -> False): redoing part0_text_document" in printed
    assert read_shard(out / names[2]) == [ids[:-1] for ids in expected_ids(other, corpus[2::3])]
    # Another tokenizer format (GPT-2 files) names other files: redone too.
    printed = run("--vocab-file", other_vocab, "--merge-file", other_merges)
    assert "tokenizer changed: redoing part2_text_document" in printed
    assert read_shard(out / names[0]) == expected_ids(other, corpus[0::3])


def test_a_shard_without_a_record_is_redone(
    corpus: list[str], bpe: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Written by another tool: what it was made from is unknown, so it is made again."""
    source = write_jsonl(tmp_path / "web.jsonl", corpus[:30])
    prefix = tmp_path / "out" / "web_text_document"
    prefix.parent.mkdir()
    indexed_writer.write_dataset(prefix, [[1, 2, 3]], np.uint16)
    (tmp_path / "out" / "web_text_document.meta.json").unlink()
    args = ["--input", source, "--output-dir", prefix.parent, "--tokenizer-model", bpe["json"]]
    assert preprocess_main(*args) == 0
    assert "no fingerprint recorded: redoing web_text_document" in capsys.readouterr().out
    assert read_shard(prefix) == expected_ids(bpe["tokenizer"], corpus[:30])


def test_truncated_gzip_input_is_one_line(bpe: dict, corpus: list[str], tmp_path: Path) -> None:
    """A damaged .jsonl.gz (cut short, or not gzip inside) names the file in one line; no
    worker traceback comes before it, and no shard is written."""
    whole = write_jsonl(tmp_path / "whole.jsonl.gz", corpus * 5).read_bytes()
    cases = {"cut.jsonl.gz": whole[: len(whole) // 2], "junk.jsonl.gz": b"\x1f\x8b" + b"x" * 900}
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        out = tmp_path / f"out-{name}"
        for program, args in (
            ("preprocess", ["--output-dir", out, "--tokenizer-model", bpe["json"], "--workers", 2]),
            ("train_tokenizer", ["--model-prefix", out / "sp", "--vocab-size", "100"]),
        ):
            result = run_job(program, "--input", path, *args)
            assert result.returncode == 1, result.stderr
            assert "Traceback" not in result.stderr and 'File "' not in result.stderr
            errors = [line for line in result.stderr.splitlines() if "rror" in line]
            assert len(errors) == 1, result.stderr
            assert errors[0].startswith(f"error: {path} cannot be read to its end"), errors
            assert "truncated or corrupt" in errors[0]
            assert not out.exists() or not [p for p in out.rglob("*") if p.is_file()]


def test_ranks_share_inputs_disjointly_and_completely(
    corpus: list[str], bpe: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inputs = [write_jsonl(tmp_path / f"shard{n:02d}.jsonl", corpus[n::5]) for n in range(5)]
    out = tmp_path / "out"
    base = ["--input", *inputs, "--output-dir", out, "--tokenizer-model", bpe["json"]]
    made: list[set[str]] = []
    for rank in range(2):
        before = set(p.name for p in out.glob("*.idx")) if out.exists() else set()
        if rank == 0:
            code = preprocess_main(*base, "--rank", "0", "--world-size", "2", "--workers", "1")
        else:  # the default comes from the scheduler's variables
            monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
            monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "2")
            code = preprocess_main(*base, "--workers", "1")
        assert code == 0
        made.append(set(p.name for p in out.glob("*.idx")) - before)
    assert made[0].isdisjoint(made[1])
    assert made[0] | made[1] == {f"shard{n:02d}_text_document.idx" for n in range(5)}
    assert made[0] == {f"shard{n:02d}_text_document.idx" for n in (0, 2, 4)}
    for n in range(5):
        expected = expected_ids(bpe["tokenizer"], corpus[n::5])
        assert read_shard(out / f"shard{n:02d}_text_document") == expected


def test_gzip_json_array_and_text_directory_inputs(
    corpus: list[str], bpe: dict, tmp_path: Path, small_ranges: None
) -> None:
    gz = write_jsonl(tmp_path / "zipped.jsonl.gz", corpus[:100], key="content")
    array = tmp_path / "array.json"
    array.write_text(json.dumps([{"content": t} for t in corpus[100:200]]), encoding="utf-8")
    array_gz = tmp_path / "array2.json.gz"
    with gzip.open(array_gz, "wt", encoding="utf-8") as stream:
        json.dump([{"content": t} for t in corpus[200:250]], stream)
    files = write_text_dir(tmp_path / "books", corpus[250:])
    books = [f.read_bytes().decode("utf-8") for f in files]
    code = preprocess_main(
        "--input", gz, array, array_gz, tmp_path / "books", "--output-dir", tmp_path / "out",
        "--text-key", "content", "--tokenizer-model", bpe["json"], "--workers", "2",
        "--remove-inputs",
    )  # fmt: skip
    assert code == 0
    tokenizer = bpe["tokenizer"]
    expected = {
        "zipped": corpus[:100],
        "array": corpus[100:200],
        "array2": corpus[200:250],
        "books": books,
    }
    for stem, texts in expected.items():
        shard = read_shard(tmp_path / "out" / f"{stem}_content_document")
        assert shard == expected_ids(tokenizer, texts), stem
    # --remove-inputs: each input goes once its shard is complete.
    assert not gz.exists() and not array.exists() and not (tmp_path / "books").exists()


def test_no_append_eod_and_gpt2_files(corpus: list[str], bpe: dict, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "web.jsonl", corpus[:50])
    code = preprocess_main(
        "--input", tmp_path / "web.jsonl", "--output-dir", tmp_path, "--vocab-file", bpe["vocab"],
        "--merge-file", bpe["merges"], "--no-append-eod", "--workers", "1",
    )  # fmt: skip
    assert code == 0
    expected = [ids[:-1] for ids in expected_ids(bpe["tokenizer"], corpus[:50])]
    assert read_shard(tmp_path / "web_text_document") == expected


def test_expected_errors_are_one_line(bpe: dict, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "web.jsonl", ["some text"])
    cases = {
        "--tokenizer-model": ("--tokenizer-model", tmp_path / "nope.model"),
        "does not exist": ("--tokenizer-model", bpe["json"], "--input", tmp_path / "x.jsonl"),
        "give .json": ("--tokenizer-model", bpe["json"], "--input", bpe["merges"]),
    }
    for expected, extra in cases.items():
        args = ["--input", tmp_path / "web.jsonl", "--output-dir", tmp_path / "out", *extra]
        result = run_job("preprocess", *args)
        assert result.returncode == 1
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines


# ---- SentencePiece -----------------------------------------------------------------------


def test_train_sentencepiece_then_preprocess(
    corpus: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_jsonl(tmp_path / "a.jsonl", corpus[:200])
    write_jsonl(tmp_path / "b.jsonl.gz", corpus[200:])
    plain = tmp_path / "plain.txt"
    plain.write_text("\n".join(corpus[:100]), encoding="utf-8")
    prefix = tmp_path / "tok" / "sp"
    args = [
        "--input", tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz", plain, "--text-key", "text",
        "--model-prefix", prefix, "--model-type", "bpe", "--vocab-size", "600",
        "--character-coverage", "1.0", "--unk-id", "1", "--bos-id", "2", "--eos-id", "3",
        "--pad-id", "0",
    ]  # fmt: skip
    result = run_job("train_tokenizer", *args)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in prefix.parent.iterdir()) == [
        "sp.model",
        "sp.model.meta.json",
        "sp.vocab",
    ]
    again = run_job("train_tokenizer", *args)
    assert again.returncode == 0 and "already exists" in again.stdout

    processor = sentencepiece.SentencePieceProcessor(model_file=f"{prefix}.model")
    assert (processor.get_piece_size(), processor.eos_id(), processor.pad_id()) == (600, 3, 0)
    code = preprocess_main(
        "--input", tmp_path / "a.jsonl", "--output-dir", tmp_path / "out",
        "--tokenizer-model", f"{prefix}.model", "--workers", "2",
    )  # fmt: skip
    assert code == 0
    expected = [ids + [3] for ids in processor.encode(corpus[:200]) if ids]
    assert read_shard(tmp_path / "out" / "a_text_document") == expected
    assert "engine sentencepiece" in capsys.readouterr().out


def test_train_tokenizer_from_plain_text_and_failure(tmp_path: Path) -> None:
    plain = tmp_path / "plain.txt"
    plain.write_text("\n".join(varied_texts(300, seed=5)), encoding="utf-8")
    prefix = tmp_path / "sp"
    base = ["--input", plain, "--model-prefix", prefix, "--character-coverage", "1.0"]
    too_big = run_job("train_tokenizer", *base, "--vocab-size", "1000000")
    assert too_big.returncode == 1
    assert too_big.stderr.strip().splitlines()[-1].startswith("error: SentencePiece training")
    assert not list(tmp_path.glob("*sp*"))
    result = run_job("train_tokenizer", *base, "--vocab-size", "300", "--max-sentences", "200")
    assert result.returncode == 0, result.stderr
    assert (
        sentencepiece.SentencePieceProcessor(model_file=f"{prefix}.model").get_piece_size() == 300
    )
    # SentencePiece's INFO log (absl's "WARNING: All log messages before ..." and the whole
    # trainer spec) only with the debug switch.
    assert "absl" not in result.stderr and "trainer_spec" not in result.stderr, result.stderr
    loud = run_job(
        "train_tokenizer", *base, "--vocab-size", "301", env={"LAUNCHER_SHOW_ALL_WARNINGS": "1"}
    )
    assert loud.returncode == 0 and "trainer_spec" in loud.stderr, loud.stderr


def test_tokenizer_is_trained_again_when_its_settings_or_inputs_change(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "a.jsonl", varied_texts(300, seed=8))
    prefix = tmp_path / "tok" / "sp"
    model = Path(f"{prefix}.model")
    base = ["--input", data, "--model-prefix", prefix, "--character-coverage", "1.0"]

    def pieces() -> int:
        return sentencepiece.SentencePieceProcessor(model_file=str(model)).get_piece_size()

    assert run_job("train_tokenizer", *base, "--vocab-size", "300").returncode == 0
    stamp = model.stat().st_mtime_ns
    again = run_job("train_tokenizer", *base, "--vocab-size", "300")
    assert again.returncode == 0 and "already exists" in again.stdout
    assert model.stat().st_mtime_ns == stamp and pieces() == 300
    # Another vocabulary size: a new tokenizer, not the one of the first run.
    bigger = run_job("train_tokenizer", *base, "--vocab-size", "400")
    assert bigger.returncode == 0, bigger.stderr
    assert f"settings changed (vocab_size 300 -> 400): training {model} again" in bigger.stdout
    assert pieces() == 400
    # A changed input: trained again.
    write_jsonl(data, varied_texts(200, seed=9))
    changed = run_job("train_tokenizer", *base, "--vocab-size", "400")
    assert f"input {data} changed: training {model} again" in changed.stdout
    assert "already exists" in run_job("train_tokenizer", *base, "--vocab-size", "400").stdout


# ---- WordPiece, sentence splitting and sentence-split datasets ---------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("One here. Two there! Three? Four.", ["One here.", "Two there!", "Three?", "Four."]),
        ("Dr. Smith met Mr. Jones. Then he left.", ["Dr. Smith met Mr. Jones.", "Then he left."]),
        ("J. R. R. Tolkien wrote it. It sold.", ["J. R. R. Tolkien wrote it.", "It sold."]),
        ("In the U.S. Army, e.g. Paris. Yes.", ["In the U.S. Army, e.g. Paris.", "Yes."]),
        ("See No. 5 and pp. 10. Said no. Then.", ["See No. 5 and pp. 10.", "Said no.", "Then."]),
        ('He said "Stop." Then (Later) more.', ['He said "Stop."', "Then (Later) more."]),
        ("Wait... 3 more. pi is 3.14 ok.", ["Wait...", "3 more. pi is 3.14 ok."]),
        ("a list\n\n  next para\nsame one.", ["a list", "next para\nsame one."]),
        ("lower. case start", ["lower. case start"]),
        ("  \n\n ", []),
        ("Ελλάδα είναι. Москва тоже.", ["Ελλάδα είναι.", "Москва тоже."]),
    ],
)
def test_sentence_splitter_rules(text: str, expected: list[str]) -> None:
    assert split_sentences(text) == expected


def test_sentence_splitter_recovers_generated_documents() -> None:
    for seed, document in enumerate(wordpiece_corpus.documents(200, seed=11)):
        assert split_sentences(wordpiece_corpus.join(document, seed)) == document


def test_wordpiece_encodes_bert_style(tmp_path: Path) -> None:
    cased = wordpiece_corpus.write_vocab(tmp_path / "cased.txt", cased=True)
    lower = wordpiece_corpus.write_vocab(tmp_path / "lower.txt", cased=False)
    vocab = cased.read_text().split()
    tokenizer = load_tokenizer(TokenizerSpec(vocab_file=str(cased)))
    assert tokenizer.eod_id is None and "eod none appended" in tokenizer.describe()
    [ids] = tokenizer.encode_batch(["The runner sat, Zebra! [SEP]"])
    # No [CLS]/[SEP] added; "[SEP]" in the text stays text: "[", "SEP", "]" (all unknown here).
    pieces = ["The", "run", "##ner", "sat", ",", "[UNK]", "!", "[UNK]", "[UNK]", "[UNK]"]
    assert [vocab[i] for i in ids] == pieces
    lowered = load_tokenizer(TokenizerSpec(vocab_file=str(lower), lower_case=True))
    [ids] = lowered.encode_batch(["The RUNNER Café"])
    assert [lower.read_text().split()[i] for i in ids] == ["the", "run", "##ner", "[UNK]"]
    [ids] = load_tokenizer(TokenizerSpec(vocab_file=str(lower))).encode_batch(["The cat"])
    assert lower.read_text().split()[ids[0]] == "[UNK]"  # cased: "The" is not in it
    with_eod = load_tokenizer(TokenizerSpec(vocab_file=str(cased), eod_token="[SEP]"))
    assert with_eod.eod_id == vocab.index("[SEP]")


def test_wordpiece_errors_are_one_line(tmp_path: Path, bpe: dict) -> None:
    no_unk = tmp_path / "no_unk.txt"
    no_unk.write_text("a\nb\n")
    vocab = wordpiece_corpus.write_vocab(tmp_path / "vocab.txt", cased=True)
    cases = [
        (TokenizerSpec(vocab_file=str(bpe["vocab"])), "--merge-file"),
        (TokenizerSpec(vocab_file=str(no_unk)), "no [UNK]"),
        (TokenizerSpec(vocab_file=str(tmp_path / "missing.txt")), "no such file"),
        (TokenizerSpec(vocab_file=str(vocab), eod_token="<eos>"), "--eod-token"),
        (TokenizerSpec(str(bpe["json"]), lower_case=True), "--lower-case"),
        (TokenizerSpec(merge_file=str(bpe["merges"])), "both --vocab-file and --merge-file"),
    ]
    for spec, fragment in cases:
        with pytest.raises(TokenizerError, match=re.escape(fragment)) as raised:
            load_tokenizer(spec)
        assert "\n" not in str(raised.value)


def test_writer_groups_sequences_into_documents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    with indexed_writer.IndexedDatasetWriter(tmp_path / "a", np.uint16) as writer:
        writer.add_sequences(np.array([1, 2, 3, 4]), np.array([1, 3]))
        writer.end_document()
        writer.add_documents(np.array([5, 6, 7, 8, 9]), np.array([2, 1, 2]), np.array([1, 2]))
        writer.add_documents(np.array([10]), np.array([1]))
    dataset = IndexedDataset(str(tmp_path / "a"))
    assert dataset.document_indices.tolist() == [0, 2, 3, 5, 6]
    assert [dataset[i].tolist() for i in range(len(dataset))] == [
        [1], [2, 3, 4], [5, 6], [7], [8, 9], [10],
    ]  # fmt: skip
    indexed_writer.write_dataset(tmp_path / "b", [[11, 12]], np.uint16)
    monkeypatch.setattr(indexed_writer, "MERGE_CHUNK", 2)  # the index streamed in slices
    merged = indexed_writer.merge_datasets([tmp_path / "a", tmp_path / "b"], tmp_path / "ab")
    assert merged.document_indices.tolist() == [0, 2, 3, 5, 6, 7]
    both = IndexedDataset(str(tmp_path / "ab"))
    assert both.document_indices.tolist() == [0, 2, 3, 5, 6, 7]
    assert both[6].tolist() == [11, 12] and both.index.sequence_pointers[6] == 20
    unended = indexed_writer.IndexedDatasetWriter(tmp_path / "c", np.uint16)
    unended.add_sequences(np.array([1]), np.array([1]))
    with pytest.raises(ValueError, match="not ended"):
        unended.finalize()
    assert not (tmp_path / "c.idx").exists() and not list(tmp_path.glob(".c.*"))


def bert_tokenizer(vocab: list[str]) -> object:
    class MegatronTokenizer:  # what the BERT dataset reads from a tokenizer
        vocab_size = len(vocab)
        inv_vocab = dict(enumerate(vocab))
        cls, sep, mask, pad = (vocab.index(t) for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]"))
        unique_identifiers = {"class": "MegatronTokenizer"}

    return MegatronTokenizer()


@pytest.fixture
def one_process_group(tmp_path: Path) -> Iterator[None]:
    """A torch.distributed group of this process alone (gloo, a file store): the BERT dataset
    asks for its rank, which needs one."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_sentence_split_dataset_is_what_megatrons_bert_dataset_reads(
    tmp_path: Path, small_ranges: None, one_process_group: None
) -> None:
    from megatron.core.datasets.bert_dataset import (
        BERTMaskedWordPieceDataset,
        BERTMaskedWordPieceDatasetConfig,
    )
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = wordpiece_corpus.documents(400, seed=5)
    write_jsonl(tmp_path / "web.jsonl", [wordpiece_corpus.join(d, n) for n, d in enumerate(docs)])
    vocab_file = wordpiece_corpus.write_vocab(tmp_path / "vocab.txt", cased=False)
    code = preprocess_main(
        "--input", tmp_path / "web.jsonl", "--output-dir", tmp_path, "--vocab-file", vocab_file,
        "--lower-case", "--split-sentences", "--workers", "3",
    )  # fmt: skip
    assert code == 0
    vocab = vocab_file.read_text().split()
    prefix = str(tmp_path / "web_text_sentence")
    dataset = IndexedDataset(prefix)
    kept = [d for d in docs if d]
    assert len(dataset) == sum(len(d) for d in kept)  # one sequence per sentence
    assert len(dataset.document_indices) - 1 == len(kept)  # grouped by document
    starts = dataset.document_indices
    for number, document in enumerate(kept):
        sentences = [dataset[i].tolist() for i in range(starts[number], starts[number + 1])]
        assert [wordpiece_corpus.decode(s, vocab) for s in sentences] == [
            s.lower() for s in document
        ]

    config = BERTMaskedWordPieceDatasetConfig(
        random_seed=1234,
        sequence_length=64,
        blend=([prefix], None),
        split="100,0,0",
        tokenizer=bert_tokenizer(vocab),
        path_to_cache=str(tmp_path / "cache"),
        masking_probability=0.15,
        short_sequence_probability=0.1,
        masking_max_ngram=3,
        masking_do_full_word=True,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False,
        classification_head=True,
    )
    train, _, _ = BlendedMegatronDatasetBuilder(
        BERTMaskedWordPieceDataset, [40, None, None], lambda: True, config
    ).build()
    assert len(train) >= 40
    document_of = np.searchsorted(starts, np.arange(len(dataset)), side="right") - 1
    for begin, end, _ in train.sample_index:
        # Each sample takes whole sentences, at least two (the next-sentence head), of one
        # document: what the .idx's document indices are for.
        assert end - begin >= 2 and document_of[begin] == document_of[end - 1]
    sample = train[0]
    assert sample["text"][0] == vocab.index("[CLS]") and vocab.index("[SEP]") in sample["text"]
