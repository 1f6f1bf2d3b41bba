"""The data-preparation job programs: tokenizing into Megatron indexed datasets, and training
a SentencePiece tokenizer. Corpora and tokenizers are generated here; nothing is downloaded."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import numpy as np
import pytest
import sentencepiece
from tokenizers import Tokenizer

from launcher_scripts.jobs.data_prep import indexed_writer, preprocess, readers
from launcher_scripts.jobs.data_prep.tokenizer import (
    PROBE_TEXTS,
    TokenizerError,
    TokenizerSpec,
    load_tokenizer,
)
from tests.data_prep_corpus import (
    EOD,
    run_job,
    save_tokenizer_files,
    train_byte_level_bpe,
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
    ]


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
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["sp.model", "sp.vocab"]
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
