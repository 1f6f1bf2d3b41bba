"""The T5 and BERT Pile recipes and the mC4 recipe: they compose, pass preflight and render for
the local, Slurm and BCP backends; bad input ends in one line naming the key; and end to end on
the local backend, against a local HTTP server, they make datasets megatron-core opens whose
tokens decode back to the text."""

from __future__ import annotations

import gzip
import io
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import sentencepiece
import zstandard

from launcher_scripts.clusters import BACKENDS
from launcher_scripts.config.compose import compose_config
from launcher_scripts.config.preflight import resolve
from launcher_scripts.formats.mc4_files import plan_files
from launcher_scripts.jobs.data_prep import mc4
from launcher_scripts.stages import STAGES, StageContext
from tests.support import wordpiece_corpus
from tests.support.commands import run_main
from tests.support.data_prep_corpus import run_job
from tests.support.http_site import Site

STAGE = "data_preparation"
PATHS = ["launcher_scripts_path=/opt/launcher", "data_dir=/data", "base_results_dir=/results"]
RECIPES = ("t5/download_t5_pile", "bert/download_bert_pile", "mt5/download_mc4")
RENDERED_BACKENDS = ("local", "bcm", "bcp")


def stage_jobs(*overrides: str) -> list:
    cfg = resolve(compose_config([*PATHS, f"stages=[{STAGE}]", *overrides]), [STAGE])
    ctx = StageContext(cfg, STAGE)
    STAGES[STAGE].validate(ctx)
    return STAGES[STAGE].jobs(ctx)


def argv_of(job) -> list[str]:
    [command] = job.commands
    return list(command.args)


# ---- compose, preflight, render ----------------------------------------------------------


@pytest.mark.parametrize("backend_name", RENDERED_BACKENDS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_renders_for_every_backend(recipe: str, backend_name: str, tmp_path: Path) -> None:
    overrides = [*PATHS, f"stages=[{STAGE}]", f"{STAGE}={recipe}"]
    cfg = resolve(compose_config(overrides), [STAGE])
    ctx = StageContext(cfg, STAGE)
    STAGES[STAGE].validate(ctx)
    backend = BACKENDS[backend_name](cfg)
    jobs = STAGES[STAGE].jobs(ctx)
    assert jobs
    for job in jobs:
        text = backend.render(job)
        assert text == backend.render(job)  # deterministic
        script = tmp_path / f"{job.name}.sh"
        script.write_text(text)
        check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr


@pytest.mark.parametrize("cluster", ["local", "bcm"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_dry_run_of_each_recipe(recipe: str, cluster: str, tmp_path: Path) -> None:
    result = run_main(
        f"stages=[{STAGE}]", f"{STAGE}={recipe}", f"cluster_type={cluster}", "dry_run=true",
        f"data_dir={tmp_path / 'data'}", f"base_results_dir={tmp_path / 'results'}",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "nothing was run or submitted" in result.stdout
    assert not (tmp_path / "data").exists()


def test_t5_and_bert_jobs_say_their_tokenizer_and_outputs() -> None:
    t5 = stage_jobs(f"{STAGE}=t5/download_t5_pile", f"{STAGE}.file_numbers='0,3'")
    assert [job.name.rsplit("-", 1)[1] for job in t5] == [
        "download_tokenizer", "download", "extract", "preprocess",
    ]  # fmt: skip
    assert argv_of(t5[0]) == [
        "--file", "https://huggingface.co/bert-large-cased/resolve/main/vocab.txt",
        "/data/bpe/vocab.txt",
    ]  # fmt: skip
    preprocess = argv_of(t5[3])
    assert preprocess[preprocess.index("--vocab-file") + 1] == "/data/bpe/vocab.txt"
    for flag in ("--merge-file", "--lower-case", "--split-sentences"):
        assert flag not in preprocess
    assert preprocess[preprocess.index("--output-prefix") + 1] == "my-t5_"
    assert t5[3].writes == ("/data/my-t5_00_text_document", "/data/my-t5_03_text_document")
    assert (t5[3].array_size, t5[3].dependency) == (2, "aftercorr")

    bert = stage_jobs(f"{STAGE}=bert/download_bert_pile", f"{STAGE}.file_numbers=7")
    assert "bert-large-uncased" in argv_of(bert[0])[1]
    preprocess = argv_of(bert[3])
    assert "--lower-case" in preprocess and "--split-sentences" in preprocess
    assert bert[3].writes == ("/data/my-bert_07_text_sentence",)


def test_custom_dataset_renders_wordpiece_sentence_data() -> None:
    """BERT and T5 data from the user's files: a WordPiece vocabulary trained on them, each
    document split into sentences, shards named _sentence."""
    corpus = Path(__file__).parent.parent / "launcher_scripts/sample_data/tiny_corpus.jsonl.gz"
    train, preprocess = stage_jobs(
        f"{STAGE}.raw_dataset_files=[{corpus}]",
        f"{STAGE}.train_tokenizer_args.model_type=wordpiece",
        f"{STAGE}.split_sentences=true",
        f"{STAGE}.lower_case=true",
    )
    vocab = "/data/custom_dataset/bpe/custom_sp_tokenizer.vocab.txt"
    argv = argv_of(train)
    assert argv[argv.index("--model-prefix") + 1] == vocab.removesuffix(".vocab.txt")
    assert "--lower-case" in argv and train.writes == (vocab,)
    argv = argv_of(preprocess)
    assert argv[argv.index("--vocab-file") + 1 :][:2] == [vocab, "--lower-case"]
    assert "--split-sentences" in argv and "--tokenizer-model" not in argv
    assert preprocess.writes == ("/data/custom_dataset/preprocessed/tiny_corpus_text_sentence",)


def test_mc4_jobs_split_files_then_languages() -> None:
    jobs = stage_jobs(
        f"{STAGE}=mt5/download_mc4", f"{STAGE}.languages=[lv,en]", f"{STAGE}.run.node_array_size=3"
    )
    names = [job.name.rsplit("-", 1)[1] for job in jobs]
    assert names == ["download_tokenizer", "download", "preprocess", "merge"]
    assert [(job.array_size, job.dependency) for job in jobs] == [
        (None, "singleton"), (3, "singleton"), (3, "aftercorr"), (2, "singleton"),
    ]  # fmt: skip
    assert argv_of(jobs[0]) == [
        "--file",
        "https://storage.googleapis.com/t5-data/vocabs/mc4.250000.100extra/sentencepiece.model",
        "/data/mc4/bpe/mt5_tokenizer.model",
        "--file",
        "https://storage.googleapis.com/t5-data/vocabs/mc4.250000.100extra/sentencepiece.vocab",
        "/data/mc4/bpe/vocab.txt",
    ]
    download = argv_of(jobs[1])
    # lv has 256 files in mC4; English comes from the cleaned C4, 1024 files.
    assert download[:4] == ["download", "--languages", "lv:256,en:1024", "--cleaned-english"]
    assert download[download.index("--url-base") + 1] == (
        "https://huggingface.co/datasets/allenai/c4/resolve/main"
    )
    assert "--remove-downloaded" not in argv_of(jobs[2])
    assert jobs[3].writes == (
        "/data/mc4/preprocessed/mc4_lv_text_document",
        "/data/mc4/preprocessed/mc4_en_text_document",
    )


def test_mc4_default_languages_and_file_names() -> None:
    [_, download, *_] = stage_jobs(f"{STAGE}=mt5/download_mc4")
    spec = argv_of(download)[2]
    languages = mc4.parse_languages(spec)
    assert [name for name, _ in languages] == (
        [
            "cs",
            "da",
            "de",
            "el",
            "en",
            "es",
            "fi",
            "fr",
            "hi",
            "hu",
            "it",
            "ja",
            "ko",
            "lt",
            "lv",
            "nl",
            "no",
            "pl",
            "pt",
            "ro",
            "ru",
            "sk",
            "sv",
            "zh",
        ]
    )
    assert dict(languages)["ru"] == 4096 and dict(languages)["no"] == 1024
    files = plan_files([("cs", 1024), ("en", 1024)], cleaned_english=True)
    assert files[0].name == "multilingual/c4-cs.tfrecord-00000-of-01024.json.gz"
    assert files[-1].name == "en/c4-train.01023-of-01024.json.gz"
    [all_download] = [j for j in stage_jobs(f"{STAGE}=mt5/download_mc4", f"{STAGE}.languages=all")
                      if j.name.endswith("-download")]  # fmt: skip
    assert len(mc4.parse_languages(argv_of(all_download)[2])) == 101


# ---- bad input: one line naming the key --------------------------------------------------


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize(
    ("recipe", "overrides", "fragments"),
    [
        ("t5/download_t5_pile", ["tokenizer_type=GPT2BPETokenizer"],
         [f"{STAGE}.tokenizer_type", "BertWordPieceCase"]),
        ("bert/download_bert_pile", ["tokenizer_type=BertWordPiece"],
         [f"{STAGE}.tokenizer_type", "'BertWordPiece' is not valid"]),
        ("t5/download_t5_pile", ["download_vocab_url=/no/such/vocab.txt"],
         [f"{STAGE}.download_vocab_url", "/no/such/vocab.txt does not exist"]),
        ("bert/download_bert_pile", ["download_vocab_url=null"],
         [f"{STAGE}.download_vocab_url", "is not set"]),
        ("bert/download_bert_pile", ["download_merges_url=http://x/merges.txt"],
         [f"{STAGE}.download_merges_url", "uses no merges file"]),
        ("t5/download_t5_pile", ["model_family=gpt5"], [f"{STAGE}.model_family", "t5"]),
        ("bert/download_bert_pile", ["output_prefix=a/b_"], [f"{STAGE}.output_prefix", "'/'"]),
        ("mt5/download_mc4", ["languages='cs,xx'"],
         [f"{STAGE}.languages", "'xx' is not a language", "language_file_counts"]),
        ("mt5/download_mc4", ["languages='cs,,de'"], [f"{STAGE}.languages", "empty entry"]),
        ("mt5/download_mc4", ["languages=[cs,cs]"], [f"{STAGE}.languages", "cs twice"]),
        ("mt5/download_mc4", ["languages=[cs,false]"], [f"{STAGE}.languages", "boolean"]),
        ("mt5/download_mc4", ["language_file_counts.cs=0"],
         [f"{STAGE}.language_file_counts.cs", "integer >= 1"]),
        ("mt5/download_mc4", ["download_tokenizer_url=/no/mt5.model"],
         [f"{STAGE}.download_tokenizer_url", "does not exist"]),
        ("mt5/download_mc4", ["c4_url=ftp://host/c4"], [f"{STAGE}.c4_url", "http(s) URL"]),
        ("mt5/download_mc4", ["download_mc4=false", "languages=lv"],
         [f"{STAGE}.c4_dir", "256 files are missing", f"{STAGE}.download_mc4=true"]),
        ("generic/custom_dataset", ["split_sentences=yes"],
         [f"{STAGE}.split_sentences", "is not true, false or null"]),
        ("generic/custom_dataset", ["train_tokenizer_args.model_type=wordpiece",
                                    "vocab_file=/elsewhere/vocab.txt"],
         [f"{STAGE}.vocab_file", "custom_sp_tokenizer.vocab.txt", "train_tokenizer=false"]),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_naming_the_key(
    recipe: str, overrides: list[str], fragments: list[str], tmp_path: Path
) -> None:
    result = run_main(
        f"stages=[{STAGE}]", f"{STAGE}={recipe}", "dry_run=true",
        f"data_dir={tmp_path / 'data'}", f"base_results_dir={tmp_path / 'results'}",
        *(f"{STAGE}.{override}" for override in overrides),
    )  # fmt: skip
    assert_one_line_error(result, *fragments)
    assert not (tmp_path / "results").exists()


def test_a_missing_tokenizer_file_is_listed_by_a_dry_run_and_refused_by_a_run(
    tmp_path: Path,
) -> None:
    """A dry run goes on past inputs it does not find (a cluster's or a workspace's files) and
    lists them; the run itself stops at the first, before anything is submitted."""
    args = (
        f"stages=[{STAGE}]",
        f"{STAGE}=generic/custom_dataset",
        f"data_dir={tmp_path / 'data'}",
        f"base_results_dir={tmp_path / 'results'}",
        f"{STAGE}.train_tokenizer=false",
        f"{STAGE}.vocab_file=/no/vocab.txt",
    )
    planned = run_main(*args, "dry_run=true")
    assert planned.returncode == 0, planned.stderr
    assert "not there yet" in planned.stdout and "/no/vocab.txt" in planned.stdout
    refused = run_main(*args)
    assert_one_line_error(refused, f"{STAGE}.vocab_file", "/no/vocab.txt")
    assert not list((tmp_path / "results").rglob("*.out"))  # no job ran


# ---- end to end on the local backend -----------------------------------------------------


def zst(data: bytes) -> bytes:
    out = io.BytesIO()
    with zstandard.ZstdCompressor().stream_writer(out, closefd=False) as writer:
        writer.write(data)
    return out.getvalue()


def jsonl(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": text, "meta": {"n": n}}) + "\n" for n, text in
                   enumerate(texts)).encode()  # fmt: skip


def serve_pile(site: Site, shards: int, seed: int) -> list[list[list[str]]]:
    """Pile-like shards 00.jsonl.zst ... on the site; returns each shard's documents."""
    served = []
    for number in range(shards):
        documents = wordpiece_corpus.documents(60, seed=seed + number)
        texts = [wordpiece_corpus.join(doc, n) for n, doc in enumerate(documents)]
        site.behaviour.files[f"{number:02d}.jsonl.zst"] = zst(jsonl(texts))
        served.append(documents)
    return served


def run_pile_recipe(site: Site, tmp_path: Path, recipe: str, cased: bool) -> Path:
    vocab = wordpiece_corpus.write_vocab(tmp_path / "vocab.txt", cased=cased)
    site.behaviour.files["vocab.txt"] = vocab.read_bytes()
    data = tmp_path / "data"
    result = run_main(
        f"stages=[{STAGE}]", f"{STAGE}={recipe}", f"data_dir={data}",
        f"base_results_dir={tmp_path / 'results'}", f"{STAGE}.the_pile_url={site.url}/",
        f"{STAGE}.file_numbers='0-1'", f"{STAGE}.download_vocab_url={site.url}/vocab.txt",
        f"{STAGE}.run.workers_per_node=2",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return data


def test_t5_recipe_end_to_end(site: Site, tmp_path: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    served = serve_pile(site, 2, seed=100)
    data = run_pile_recipe(site, tmp_path, "t5/download_t5_pile", cased=True)
    vocab = (data / "bpe" / "vocab.txt").read_text().split()
    # The .zst and .jsonl files are gone (rm_downloaded, rm_extracted).
    assert sorted(p.name for p in data.iterdir()) == [
        "bpe",
        "my-t5_00_text_document.bin", "my-t5_00_text_document.idx",
        "my-t5_00_text_document.meta.json",
        "my-t5_01_text_document.bin", "my-t5_01_text_document.idx",
        "my-t5_01_text_document.meta.json",
    ]  # fmt: skip
    for number, documents in enumerate(served):
        dataset = IndexedDataset(str(data / f"my-t5_{number:02d}_text_document"))
        expected = [" ".join(doc) for doc in documents if doc]
        assert len(dataset) == len(expected)  # one sequence per document, nothing appended
        assert dataset.document_indices.tolist() == list(range(len(expected) + 1))
        decoded = [wordpiece_corpus.decode(dataset[i].tolist(), vocab) for i in range(len(dataset))]
        assert decoded == expected  # cased: the text as written


def test_bert_recipe_end_to_end(site: Site, tmp_path: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    served = serve_pile(site, 2, seed=200)
    data = run_pile_recipe(site, tmp_path, "bert/download_bert_pile", cased=False)
    vocab = (data / "bpe_uncased" / "vocab.txt").read_text().split()
    for number, documents in enumerate(served):
        dataset = IndexedDataset(str(data / f"my-bert_{number:02d}_text_sentence"))
        kept = [doc for doc in documents if doc]
        assert len(dataset) == sum(len(doc) for doc in kept)  # a sequence per sentence
        starts = dataset.document_indices.tolist()
        assert starts == np.cumsum([0] + [len(doc) for doc in kept]).tolist()
        for index, document in enumerate(kept):
            sentences = [dataset[i].tolist() for i in range(starts[index], starts[index + 1])]
            decoded = [wordpiece_corpus.decode(ids, vocab) for ids in sentences]
            assert decoded == [sentence.lower() for sentence in document]


def test_custom_dataset_prepares_bert_and_t5_data(tmp_path: Path) -> None:
    """The default corpus, a WordPiece vocabulary trained on it and sentence-split shards:
    what the BERT and T5 recipes read, made with no download. A second run redoes nothing."""
    overrides = (
        f"stages=[{STAGE}]", f"data_dir={tmp_path / 'data'}",
        f"base_results_dir={tmp_path / 'results'}",
        f"{STAGE}.train_tokenizer_args.model_type=wordpiece",
        f"{STAGE}.train_tokenizer_args.vocab_size=1000",
        f"{STAGE}.split_sentences=true", f"{STAGE}.lower_case=true",
    )  # fmt: skip
    result = run_main(*overrides)
    assert result.returncode == 0, result.stdout + result.stderr
    folder = tmp_path / "data" / "custom_dataset"
    vocab = (folder / "bpe" / "custom_sp_tokenizer.vocab.txt").read_text().splitlines()
    assert vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert len(set(vocab)) == len(vocab) == 1000
    assert all(token == token.lower() for token in vocab[5:])  # lower_case
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data = IndexedDataset(str(folder / "preprocessed" / "tiny_corpus_text_sentence"))
    documents = len(data.document_indices) - 1
    assert documents == 4000 and len(data) > 2 * documents  # several sentences a document
    assert max(int(data[i].max()) for i in range(len(data))) < 1000
    again = run_main(*overrides)
    assert again.returncode == 0 and "skip: " in again.stdout + again.stderr


def train_sentencepiece(texts: list[str], vocab_size: int = 120) -> bytes:
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size,
        character_coverage=1.0, model_type="unigram", bos_id=-1, eos_id=1, unk_id=2, pad_id=0,
        hard_vocab_limit=False, minloglevel=2,
    )  # fmt: skip
    return model.getvalue()


def serve_mc4(site: Site, languages: list[tuple[str, int]], seed: int) -> dict[str, list[str]]:
    """Tiny mC4 files on the site; returns each language's documents in file order."""
    expected: dict[str, list[str]] = {}
    for number, file in enumerate(plan_files(languages, cleaned_english=True)):
        docs = [" ".join(doc) for doc in wordpiece_corpus.documents(15, seed=seed + number)]
        site.behaviour.files[file.name] = gzip.compress(jsonl(docs))
        expected.setdefault(file.language, []).extend(doc for doc in docs if doc)
    return expected


def test_mc4_recipe_end_to_end(site: Site, tmp_path: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    languages = [("cs", 2), ("en", 3)]  # en: the cleaned C4 files, en/c4-train...
    expected = serve_mc4(site, languages, seed=300)
    model = train_sentencepiece([t for texts in expected.values() for t in texts])
    site.behaviour.files["mt5.model"] = model
    data = tmp_path / "data"
    result = run_main(
        f"stages=[{STAGE}]", f"{STAGE}=mt5/download_mc4", f"data_dir={data}",
        f"base_results_dir={tmp_path / 'results'}", f"{STAGE}.languages=[cs,en]",
        f"{STAGE}.language_file_counts.cs=2", f"{STAGE}.cleaned_english_file_count=3",
        f"{STAGE}.c4_url={site.url}", f"{STAGE}.download_tokenizer_url={site.url}/mt5.model",
        f"{STAGE}.download_vocab_url=null", f"{STAGE}.run.workers_per_node=2",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    processor = sentencepiece.SentencePieceProcessor(model_proto=model)
    preprocessed = data / "mc4" / "preprocessed"
    # The per-file datasets are merged and removed.
    assert sorted(p.name for p in preprocessed.iterdir()) == [
        "mc4_cs_text_document.bin", "mc4_cs_text_document.idx", "mc4_cs_text_document.meta.json",
        "mc4_en_text_document.bin", "mc4_en_text_document.idx", "mc4_en_text_document.meta.json",
    ]  # fmt: skip
    for language, texts in expected.items():
        dataset = IndexedDataset(str(preprocessed / f"mc4_{language}_text_document"))
        assert len(dataset.document_indices) - 1 == len(texts) == len(dataset)
        ids = [dataset[i].tolist() for i in range(len(dataset))]
        assert all(processor.eos_id() not in doc for doc in ids)  # no EOD appended
        assert processor.decode(ids) == texts
    # rm_downloaded is false: the files stay, laid out as in allenai/c4.
    assert (data / "mc4/c4/en/c4-train.00002-of-00003.json.gz").is_file()
    assert (data / "mc4/c4/multilingual/c4-cs.tfrecord-00001-of-00002.json.gz").is_file()


# ---- the mc4 job program -----------------------------------------------------------------


def test_mc4_steps_share_files_skip_finished_work_and_merge(site: Site, tmp_path: Path) -> None:
    languages = [("lv", 3), ("lt", 2)]
    expected = serve_mc4(site, languages, seed=400)
    model = tmp_path / "sp.model"
    model.write_bytes(train_sentencepiece([t for texts in expected.values() for t in texts]))
    c4, out = tmp_path / "c4", tmp_path / "out"
    spec = ["--languages", "lv:3,lt:2", "--rank"]
    fetched: list[set[str]] = []
    for rank in range(2):
        before = {p for p in c4.rglob("*.gz")} if c4.exists() else set()
        result = run_job(
            "mc4", "download", *spec, rank, "--world-size", 2, "--c4-dir", c4,
            "--url-base", site.url, "--output-dir", out, "--retry-wait", 0,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        fetched.append({p.name for p in set(c4.rglob("*.gz")) - before})
    assert not fetched[0] & fetched[1] and len(fetched[0] | fetched[1]) == 5
    early = run_job("mc4", "merge", "--languages", "lv:3,lt:2", "--output-dir", out)
    assert early.returncode == 1
    assert early.stderr.strip().splitlines() == [
        "mc4 merge: error: 3 of the 3 files of mc4_lv_text_document are not tokenized "
        "(first: c4-lv.tfrecord-00000-of-00003_text_document); re-run the preprocess step"
    ]
    for rank in range(2):
        result = run_job(
            "mc4", "preprocess", *spec, rank, "--world-size", 2, "--c4-dir", c4,
            "--output-dir", out, "--tokenizer-model", model, "--workers", 1,
            "--remove-downloaded",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
    assert not list(c4.rglob("*.gz"))  # --remove-downloaded
    merged = run_job("mc4", "merge", "--languages", "lv:3,lt:2", "--output-dir", out)
    assert merged.returncode == 0, merged.stderr
    assert "merged 3 files" in merged.stdout and not (out / mc4.PARTS_DIR).exists()
    # Everything again: nothing is fetched, tokenized or merged twice.
    requests = len(site.behaviour.requests)
    again = [
        run_job("mc4", "download", *spec, 0, "--world-size", 1, "--c4-dir", c4,
                "--url-base", site.url, "--output-dir", out),
        run_job("mc4", "preprocess", *spec, 0, "--world-size", 1, "--c4-dir", c4,
                "--output-dir", out, "--tokenizer-model", model),
        run_job("mc4", "merge", "--languages", "lv:3,lt:2", "--output-dir", out),
    ]  # fmt: skip
    assert all(result.returncode == 0 for result in again), [r.stderr for r in again]
    assert len(site.behaviour.requests) == requests
    assert "nothing to tokenize" in again[1].stdout and "already complete" in again[2].stdout


def test_mc4_languages_made_with_another_tokenizer_are_made_again(
    site: Site, tmp_path: Path
) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    expected = serve_mc4(site, [("lv", 2), ("lt", 1)], seed=500)
    texts = [t for language in expected.values() for t in language]
    models = {}
    for name, size in (("first", 120), ("second", 90)):
        models[name] = tmp_path / f"{name}.model"
        models[name].write_bytes(train_sentencepiece(texts, vocab_size=size))
    c4, out = tmp_path / "c4", tmp_path / "out"
    common = ["--languages", "lv:2,lt:1", "--rank", 0, "--world-size", 1]

    def steps(model: Path, *preprocess: str) -> list[subprocess.CompletedProcess[str]]:
        results = [
            run_job("mc4", "download", *common, "--c4-dir", c4, "--url-base", site.url,
                    "--output-dir", out, "--tokenizer-model", model, "--retry-wait", 0),
            run_job("mc4", "preprocess", *common, "--c4-dir", c4, "--output-dir", out,
                    "--tokenizer-model", model, "--workers", 1, *preprocess),
            run_job("mc4", "merge", *common, "--output-dir", out),
        ]  # fmt: skip
        assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
        return results

    def tokens(language: str) -> list[list[int]]:
        dataset = IndexedDataset(str(out / f"mc4_{language}_text_document"))
        return [dataset[i].tolist() for i in range(len(dataset))]

    steps(models["first"], "--remove-downloaded")
    first = sentencepiece.SentencePieceProcessor(model_file=str(models["first"]))
    assert tokens("lv") == first.encode(expected["lv"])
    requests = len(site.behaviour.requests)
    # Another tokenizer: the removed files are fetched again, tokenized and merged anew.
    download, tokenize, merge = steps(models["second"])
    assert len(site.behaviour.requests) == requests + 3
    for result in (download, tokenize, merge):
        assert "tokenizer changed" in result.stdout and "redoing mc4_lv_text_document" in (
            result.stdout
        ), result.stdout
    second = sentencepiece.SentencePieceProcessor(model_file=str(models["second"]))
    for language in ("lv", "lt"):
        assert (
            tokens(language)
            == second.encode(expected[language])
            != first.encode(expected[language])
        )
    # The same again: nothing is fetched, tokenized or merged.
    requests = len(site.behaviour.requests)
    download, tokenize, merge = steps(models["second"])
    assert len(site.behaviour.requests) == requests
    assert "nothing to tokenize" in tokenize.stdout and "already complete" in merge.stdout


def test_mc4_languages_are_balanced_by_file_count() -> None:
    counts = {"en": 1024, "ru": 4096, "lv": 256, "lt": 512, "cs": 1024}
    order = list(counts)
    shares = [mc4.balanced_share(order, counts, rank, 2) for rank in range(2)]
    assert shares == [["ru"], ["en", "lv", "lt", "cs"]]
    assert sorted(sum(shares, [])) == sorted(order)
    with pytest.raises(ValueError, match="LANG:COUNT"):
        mc4.parse_languages("cs:1024,de")
