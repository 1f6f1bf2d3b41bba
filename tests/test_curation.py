"""data_curation: each step on labelled documents, dedup against exact Jaccard, decontamination,
language splitting, bad input, resumption, and the same output from one process or an array."""

from __future__ import annotations

import gzip
import json
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launcher_scripts.curation.document import Document
from launcher_scripts.curation.step import steps
from tests.support import REPO
from tests.support.commands import assert_one_line_error, one_error_line, run_main
from tests.support.curation import (
    curate_overrides,
    english_document,
    mixed_corpus,
    output_files,
    output_ids,
    output_records,
    phase_command,
    planted_corpus,
    run_phase,
    stage_config,
    true_removals,
    vocabulary,
    write_shards,
)

RECIPE = OmegaConf.load(REPO / "conf" / "data_curation" / "jsonl.yaml")


def report(root: Path) -> dict:
    return json.loads((root / "results" / "curate_jsonl" / "curation_report.json").read_text())


# ----- fuzzy and exact dedup ------------------------------------------------------------------


def test_fuzzy_dedup_finds_the_planted_near_duplicates_exact_jaccard_finds(tmp_path: Path) -> None:
    # 300 documents, each with an exact copy and variants with 1% to 15% of their words
    # replaced: Jaccard similarities of 5-word shingles from about 0.3 to 1.0, many of them
    # within a few hundredths of the 0.8 threshold.
    texts = planted_corpus(7, 300, (0.0, 0.01, 0.02, 0.04, 0.08, 0.15))
    files = write_shards(tmp_path / "raw", texts, 4)
    truth = true_removals(texts, 0.8, 5)
    result = run_main(
        *curate_overrides(
            tmp_path,
            files,
            "data_curation.steps=[]",
            "data_curation.tasks=4",
            "data_curation.run.workers_per_node=2",
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    removed = set(range(len(texts))) - output_ids(tmp_path / "curated")
    true_positives = len(removed & truth)
    precision, recall = true_positives / len(removed), true_positives / len(truth)
    assert precision >= 0.99 and recall >= 0.95, (precision, recall, len(removed), len(truth))
    dedup = report(tmp_path)["dedup"]
    assert dedup["removed"] == len(removed)
    assert (
        sum(int(size) * count for size, count in dedup["cluster_sizes"].items())
        == dedup["documents_in_clusters"]
    )


def test_exact_dedup_alone_removes_identical_texts_after_cleaning(tmp_path: Path) -> None:
    rng = random.Random(3)
    originals = [english_document(rng) for _ in range(40)]
    # Copies that differ only in spacing (cleaning makes them identical), and near copies
    # (one sentence changed) that exact dedup must keep.
    spaced = [text.replace(" ", "  ", 3) for text in originals[:10]]
    near = [text.rsplit("\n", 1)[0] + "\n" + english_document(rng, 3) for text in originals[10:20]]
    texts = originals + spaced + near
    files = write_shards(tmp_path / "raw", texts, 1)
    result = run_main(
        *curate_overrides(
            tmp_path,
            files,
            "data_curation.steps=[clean]",
            "data_curation.fuzzy_dedup.enabled=false",
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert output_ids(tmp_path / "curated") == set(range(40)) | set(range(50, 60))
    assert report(tmp_path)["dedup"]["cluster_sizes"] == {"2": 10}


# ----- the document steps -------------------------------------------------------------------


def test_each_heuristic_rule_removes_what_it_is_labelled_for() -> None:
    rng = random.Random(5)
    good = [english_document(rng) for _ in range(20)]
    lorem = english_document(rng) + "\nLorem ipsum dolor sit amet, consectetur adipiscing elit."
    labelled = {
        "gopher_quality.gopher_short_doc": "A short note. It has few words. Nothing else here.",
        "gopher_repetition.dup_line_frac": "\n".join(["Buy the best shoes in town today."] * 30),
        "c4_quality.lorem_ipsum": lorem,
        "url_ratio.too_many_urls": english_document(rng, 6)
        + "\n"
        + " ".join(f"https://example.com/page/{i}" for i in range(40))
        + ".",
        "gopher_quality.gopher_below_alpha_threshold": english_document(rng, 6)
        + "\n"
        + " ".join(f"{i} {i * 7} {i * 13}." for i in range(60)),
    }
    chain = steps()["heuristics"].build(RECIPE.heuristics, Path("."))
    for text in good:
        assert chain(Document("good", text)) is None, text
    for reason, text in labelled.items():
        rule = reason.split(".")[0]
        alone = OmegaConf.create({"rules": {rule: RECIPE.heuristics.rules[rule]}})
        assert steps()["heuristics"].build(alone, Path("."))(Document(reason, text)) == reason
        assert chain(Document(reason, text)) is not None


def test_a_rule_set_to_null_is_off_and_thresholds_come_from_the_recipe() -> None:
    urls = (
        english_document(random.Random(1), 6)
        + "\n"
        + " ".join(f"https://example.com/{i}" for i in range(40))
        + "."
    )
    only_urls = OmegaConf.create({"rules": {"url_ratio": {}, "fineweb_quality": None}})
    assert steps()["heuristics"].build(only_urls, Path("."))(Document("u", urls)) is not None
    off = OmegaConf.create({"rules": {"url_ratio": None, "fineweb_quality": {}}})
    assert steps()["heuristics"].build(off, Path("."))(Document("u", urls)) is None
    stricter = OmegaConf.merge(
        RECIPE.heuristics, {"rules": {"gopher_quality": {"min_doc_words": 1000}}}
    )
    reason = steps()["heuristics"].build(stricter, Path("."))(
        Document("g", english_document(random.Random(2)))
    )
    assert reason == "gopher_quality.gopher_short_doc"


def test_cleaning_repairs_mojibake_and_whitespace_and_drops_boilerplate_lines() -> None:
    section = OmegaConf.create(
        {"fix_unicode": True, "normalize_whitespace": True, "remove_lines": ["^Accept cookies"]}
    )
    doc = Document(
        "d", "The caf\u00c3\u00a9   opened.  \n\n\n\nAccept cookies to continue\nIt was  warm."
    )
    assert steps()["clean"].build(section, Path("."))(doc) is None
    assert doc.text == "The café opened.\n\nIt was warm."
    empty = Document("e", "Accept cookies now\n   \n")
    assert steps()["clean"].build(section, Path("."))(empty) == "empty_after_cleaning"


def test_the_shipped_language_model_tells_english_german_and_french_apart() -> None:
    section = OmegaConf.create({"model": None, "languages": ["en", "de"], "min_score": 0.5})
    identify = steps()["language"].build(section, Path("."))
    samples = {
        "en": "The old bridge over the river was repaired after the long winter.",
        "de": "Die alte Brücke über den Fluss wurde nach dem langen Winter repariert.",
        "fr": "Le vieux pont sur la rivière a été réparé après le long hiver.",
    }
    verdicts = {}
    for code, text in samples.items():
        doc = Document(code, text)
        verdicts[code] = identify(doc)
        assert doc.meta["language"] == code
    assert verdicts == {"en": None, "de": None, "fr": "language_not_wanted"}


def _invented_language(rng: random.Random, consonants: str, vowels: str, words: int) -> str:
    syllables = [c + v for c in consonants for v in vowels]
    return " ".join(
        "".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(words)
    )


def test_a_fasttext_model_the_user_trains_splits_the_output_by_language(tmp_path: Path) -> None:
    import fasttext

    rng = random.Random(11)
    languages = {"xa": ("bdgk", "ao"), "xb": ("lmnr", "ei")}
    training = tmp_path / "lid.txt"
    training.write_text(
        "".join(
            f"__label__{code} {_invented_language(rng, *letters, 30)}\n"
            for _ in range(200)
            for code, letters in languages.items()
        )
    )
    model = fasttext.train_supervised(str(training), epoch=5, minn=2, maxn=3, verbose=0)
    model.save_model(str(tmp_path / "lid.bin"))
    texts, codes = [], []
    for index in range(60):
        code = "xa" if index % 3 else "xb"
        texts.append(_invented_language(rng, *languages[code], 80))
        codes.append(code)
    files = write_shards(tmp_path / "raw", texts, 2)
    result = run_main(
        *curate_overrides(
            tmp_path,
            files,
            "data_curation.steps=[language]",
            f"data_curation.language.model={tmp_path / 'lid.bin'}",
            "data_curation.language.languages=null",
            "data_curation.split_by_language=true",
            "data_curation.tasks=2",
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for code in languages:
        written = output_ids(tmp_path / "curated" / code)
        assert written == {i for i, c in enumerate(codes) if c == code}
    assert report(tmp_path)["languages"] == {"xa": 40, "xb": 20}


def test_decontamination_removes_documents_holding_task_passages(tmp_path: Path) -> None:
    rng = random.Random(8)
    passages = [english_document(rng, 2, 2) for _ in range(5)]
    task = tmp_path / "task.jsonl"
    task.write_text(
        "".join(
            json.dumps({"input": f"Question {i}: {p}", "output": "yes", "choices": ["a", "b"]})
            + "\n"
            for i, p in enumerate(passages)
        )
    )
    texts = [english_document(rng) for _ in range(30)]
    holding = {3, 11, 17, 25}
    for number, index in enumerate(sorted(holding)):
        lines = texts[index].split("\n")
        lines.insert(2, passages[number])
        texts[index] = "\n".join(lines)
    files = write_shards(tmp_path / "raw", texts, 1)
    result = run_main(
        *curate_overrides(
            tmp_path,
            files,
            "data_curation.steps=[decontamination]",
            f"data_curation.decontamination.task_files=[{task}]",
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert output_ids(tmp_path / "curated") == set(range(30)) - holding
    assert report(tmp_path)["removed"] == {"decontamination: contains_task_text": 4}


# ----- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        (
            "data_curation.language.model=/no/lid.176.bin",
            ("data_curation.language.model", "does not exist"),
        ),
        (
            "data_curation.fuzzy_dedup.threshold=1.5",
            ("data_curation.fuzzy_dedup.threshold", "strictly between 0 and 1"),
        ),
        (
            "data_curation.language.min_score=0",
            ("data_curation.language.min_score", "strictly between"),
        ),
        (
            "+data_curation.heuristics.rules.gopher_quality.max_words=5",
            ("gopher_quality.max_words", "not a parameter"),
        ),
        (
            "data_curation.heuristics.rules.fineweb_quality.line_punct_thr=2",
            ("line_punct_thr", "strictly between"),
        ),
        ("data_curation.steps=[clean,dedup]", ("data_curation.steps[1]", "not a step")),
        ("data_curation.tasks=3", ("data_curation.tasks", "1 files")),
        ("data_curation.source.kind=pdf", ("data_curation.source.kind", "not a source")),
        ("data_curation.steps=[classifier]", ("data_curation.classifier.positive", "is empty")),
        (
            "data_curation.steps=[decontamination]",
            ("data_curation.decontamination.task_files", "is empty"),
        ),
        (
            "data_curation.output_dir=${data_curation.work_dir}/out",
            ("data_curation.output_dir", "overlap"),
        ),
    ],
)
def test_bad_settings_are_one_line_before_anything_runs(
    tmp_path: Path, override: str, fragments: tuple[str, ...]
) -> None:
    result = run_main(
        "stages=[data_curation]",
        f"base_results_dir={tmp_path}/results",
        f"data_dir={tmp_path}/d",
        override,
    )
    assert_one_line_error(result, *fragments)
    assert not (tmp_path / "d").exists() and not (tmp_path / "results").exists()


def test_unreadable_records_are_skipped_and_counted(tmp_path: Path) -> None:
    rng = random.Random(4)
    raw = tmp_path / "raw"
    raw.mkdir()
    good = [english_document(rng) for _ in range(200)]
    lines = [json.dumps({"id": i, "text": t}).encode() for i, t in enumerate(good)]
    lines[10] = b'{"id": 10, "text": "cut off'  # not JSON
    lines[20] = json.dumps({"id": 20, "title": "no text"}).encode()
    lines[30] = '{"id": 30, "text": "caf\u00e9"}'.encode("latin-1")  # not UTF-8
    (raw / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (raw / "empty.jsonl").write_bytes(b"")
    whole = gzip.compress(b"\n".join(lines[:100]) + b"\n")
    (raw / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])  # truncated
    files = [raw / "a.jsonl", raw / "empty.jsonl", raw / "cut.jsonl.gz"]
    result = run_main(
        *curate_overrides(
            tmp_path,
            files,
            "data_curation.steps=[]",
            "data_curation.exact_dedup=false",
            "data_curation.fuzzy_dedup.enabled=false",
            "data_curation.tasks=3",
            "data_curation.max_bad_fraction=0.1",
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    written = report(tmp_path)
    assert written["bad_records"].keys() == {
        "not_json",
        "no_text_key_text",
        "not_utf8",
        "truncated_or_corrupt_file",
    }
    assert written["bad_records"]["not_json"] == 2  # line 11 of both files
    assert "cut.jsonl.gz" in written["bad_examples"]["truncated_or_corrupt_file"][0]
    kept = output_records(tmp_path / "curated")
    assert {int(r["id"]) for r in kept if r["source"] == "a.jsonl"} == set(range(200)) - {
        10,
        20,
        30,
    }
    assert 0 < sum(r["source"] == "cut.jsonl.gz" for r in kept) < 100


def test_too_many_unreadable_records_fail_the_task_in_one_line_and_write_nothing(
    tmp_path: Path,
) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "junk.jsonl").write_text("not json\n" * 5 + json.dumps({"text": "fine"}) + "\n")
    result = run_main(*curate_overrides(tmp_path, [raw / "junk.jsonl"], "data_curation.steps=[]"))
    one_error_line(result, "curate_jsonl-documents")
    log = next((tmp_path / "results" / "curate_jsonl").glob("log-curate_jsonl-documents_*.out"))
    assert "5 of 6 records could not be read" in log.read_text()
    assert "max_bad_fraction" in log.read_text()
    assert not (tmp_path / "curated").exists()
    assert not list((tmp_path / "work" / "documents").glob("0*"))


# ----- arrays and resumption ----------------------------------------------------------------


def _configured(root: Path, texts: list[str], shards: int, *extra: str) -> Path:
    """The stage's resolved config for a curation of `texts` under `root` (a dry run)."""
    files = write_shards(root / "raw", texts, shards)
    args = curate_overrides(
        root,
        files,
        "data_curation.steps=[clean,heuristics]",
        f"data_curation.tasks={shards}",
        "data_curation.dedup_partitions=3",
        "dry_run=true",
        *extra,
    )
    result = run_main(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    return stage_config(root)


def test_an_array_of_tasks_writes_what_one_process_writes(tmp_path: Path) -> None:
    texts = mixed_corpus(21, 400)
    single = _configured(tmp_path / "single", texts, 4)
    array = _configured(tmp_path / "array", texts, 4)
    for phase in ("documents", "buckets", "components", "write", "report"):
        done = run_phase(single, phase)
        assert done.returncode == 0, done.stderr[-3000:]
        for rank in range(2):  # two array tasks, one of them with two workers
            done = run_phase(array, phase, rank, 2, workers=1 + rank)
            assert done.returncode == 0, done.stderr[-3000:]
    assert output_files(tmp_path / "single") == output_files(tmp_path / "array")
    assert len(output_records(tmp_path / "single" / "curated")) < len(texts) - 5


def test_a_task_killed_mid_shard_is_redone_and_the_output_is_the_same(tmp_path: Path) -> None:
    texts = mixed_corpus(22, 2400)
    reference = _configured(tmp_path / "reference", texts, 4)
    killed = _configured(tmp_path / "killed", texts, 4)
    for phase in ("documents", "buckets", "components", "write"):
        assert run_phase(reference, phase).returncode == 0
    work = tmp_path / "killed" / "work" / "documents"
    argv, env = phase_command(killed, "documents")
    process = subprocess.Popen(
        argv,
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    while not (work / "00000" / "stats.json").exists() and process.poll() is None:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL
    assert not (work / "00003").exists()  # killed before its last task
    rerun = run_phase(killed, "documents")
    assert rerun.returncode == 0 and "(1 done before, skipped)" in rerun.stdout, rerun.stdout
    assert not list(work.glob(".*"))  # the killed task's partial folder is gone
    for phase in ("buckets", "components", "write"):
        assert run_phase(killed, phase).returncode == 0
    assert output_files(tmp_path / "killed") == output_files(tmp_path / "reference")


@pytest.mark.slow
def test_curated_output_trains_through_data_preparation_in_one_run(tmp_path: Path) -> None:
    # The README's curation command on the shipped corpus, training shortened.
    result = run_main(
        "stages=[data_curation,data_preparation,training]",
        "data_preparation=generic/curated",
        f"data_dir={tmp_path}/data",
        f"base_results_dir={tmp_path}/results",
        "training.trainer.max_steps=20",
        "training.trainer.log_every_n_steps=5",
        "training.trainer.val_check_interval=10",
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    curated = tmp_path / "data" / "curated" / "tiny_corpus"
    assert [p.name for p in curated.iterdir()] == ["part_00000.jsonl"]
    kept = len(output_records(curated))
    assert 1000 < kept < 4000  # the quality rules remove some of the shipped corpus
    prepared = tmp_path / "data" / "custom_dataset" / "preprocessed"
    assert (prepared / "tiny_corpus_text_document.bin").stat().st_size > 0
    assert "20/20" in result.stdout and "loss" in result.stdout


def test_a_quality_classifier_trained_on_examples_keeps_prose_and_removes_junk(
    tmp_path: Path,
) -> None:
    rng = random.Random(12)
    examples = tmp_path / "examples"
    examples.mkdir()
    (examples / "good.jsonl").write_text(
        "".join(json.dumps({"text": english_document(rng, 4)}) + "\n" for _ in range(300))
    )
    spam = vocabulary(random.Random(99), 3000)  # what crawl junk repeats: one vocabulary

    def salad() -> str:
        return " ".join(rng.choice(spam) for _ in range(rng.randint(60, 200)))

    (examples / "junk.txt").write_text("\n".join(salad() for _ in range(300)) + "\n")
    prose = [english_document(rng) for _ in range(40)]
    junk = [salad() for _ in range(40)]
    files = write_shards(tmp_path / "raw", prose + junk, 2)
    result = run_main(
        *curate_overrides(
            tmp_path,
            files,
            "data_curation.steps=[classifier]",
            f"data_curation.classifier.positive=[{examples / 'good.jsonl'}]",
            f"data_curation.classifier.negative=[{examples / 'junk.txt'}]",
            "data_curation.tasks=2",
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = output_records(tmp_path / "curated")
    assert {int(r["id"]) for r in records} == set(range(40))
    assert min(r["quality_score"] for r in records) >= 0.5
    assert report(tmp_path)["removed"] == {"classifier: quality_score_below_threshold": 40}


def test_decontamination_reads_lm_eval_tasks_by_name(tmp_path: Path) -> None:
    lambada = REPO / "launcher_scripts" / "sample_data" / "eval_tasks" / "tiny_lambada.jsonl"
    passages = [json.loads(line)["text"] for line in lambada.read_text().splitlines()[:3]]
    rng = random.Random(9)
    texts = [english_document(rng) for _ in range(20)]
    for index, passage in zip((2, 9, 15), passages, strict=True):
        texts[index] = texts[index] + "\n" + passage
    files = write_shards(tmp_path / "raw", texts, 1)
    result = run_main(
        *curate_overrides(
            tmp_path,
            files,
            "data_curation.steps=[decontamination]",
            "data_curation.decontamination.lm_eval_tasks=[tiny_lambada,tiny_choice]",
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert output_ids(tmp_path / "curated") == set(range(20)) - {2, 9, 15}


def test_a_job_without_the_curation_packages_says_so_in_one_line(tmp_path: Path) -> None:
    # ftfy hidden from the job: a module of that name that cannot be imported.
    hidden = tmp_path / "hide"
    (hidden / "ftfy").mkdir(parents=True)
    (hidden / "ftfy" / "__init__.py").write_text("raise ModuleNotFoundError(name='ftfy')\n")
    files = write_shards(tmp_path / "raw", ["One small document."], 1)
    result = run_main(
        *curate_overrides(tmp_path, files, "data_curation.steps=[clean]"),
        extra_env={"PYTHONPATH": f"{hidden}:{REPO}"},
    )
    one_error_line(result, "curate_jsonl-documents")
    log = next((tmp_path / "results" / "curate_jsonl").glob("log-curate_jsonl-documents_*.out"))
    assert "need the package ftfy" in log.read_text() and "Traceback" not in log.read_text()
