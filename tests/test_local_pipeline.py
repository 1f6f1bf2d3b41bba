"""The whole launcher on the local backend: compose, run the jobs, record, status, logs, cancel."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sentencepiece
import zstandard
from megatron.core.datasets.indexed_dataset import IndexedDataset

from launcher_scripts.config.resolvers import launcher_root
from tests.support import REPO
from tests.support.commands import run_main, run_ops
from tests.support.http_site import Site
from tests.support.manifests import write_run_manifest
from tests.support.pile import (
    SAMPLE,
    assert_pile_tokenized,
    pile_overrides,
    sample_texts,
    serve_pile,
)


def status_json(target: Path) -> dict:
    result = run_ops("status", str(target), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def job_states(target: Path) -> dict[str, str]:
    return {
        job["name"]: job["state"]
        for stage in status_json(target)["stages"]
        for job in stage["jobs"]
    }


def test_default_run_prepares_the_sample_corpus(tmp_path: Path) -> None:
    results, data = tmp_path / "results", tmp_path / "data"
    overrides = (f"base_results_dir={results}", f"data_dir={data}")
    result = run_main(
        *overrides,
        "stages=[data_preparation]",
        "data_preparation.train_tokenizer_args.vocab_size=1000",
    )
    assert result.returncode == 0, result.stdout + result.stderr

    stage_dir = results / "custom_dataset"
    assert (stage_dir / "custom_dataset_hydra.yaml").is_file()
    assert (stage_dir / "custom_dataset-preprocess_submission.sh").is_file()
    states = job_states(stage_dir)
    assert states == {
        "custom_dataset-train_tokenizer": "COMPLETED",
        "custom_dataset-preprocess": "COMPLETED",
    }
    manifest = status_json(results)  # the base results folder finds the newest run
    stage = manifest["stages"][0]
    assert stage["config"] == str(stage_dir / "custom_dataset_hydra.yaml")
    assert all(job["exit_code"] == 0 and job["start"] and job["end"] for job in stage["jobs"])
    assert all(Path(job["log"]).is_file() for job in stage["jobs"])
    prefix = data / "custom_dataset" / "preprocessed" / "tiny_corpus_text_document"
    assert str(prefix) in stage["artifacts"]

    # What megatron-core reads is what the tokenizer makes of each document, plus the EOD.
    tokenizer = sentencepiece.SentencePieceProcessor(
        model_file=str(data / "custom_dataset" / "bpe" / "custom_sp_tokenizer.model")
    )
    dataset = IndexedDataset(str(prefix))
    texts = sample_texts()
    assert len(dataset) == len(texts)
    for index in (0, 1, len(texts) - 1):
        expected = tokenizer.encode(texts[index]) + [tokenizer.eos_id()]
        assert dataset[index].tolist() == expected

    text = run_ops("status", str(stage_dir)).stdout
    assert "custom_dataset-preprocess" in text and "COMPLETED" in text
    logs = run_ops("logs", str(stage_dir), "custom_dataset-preprocess")
    assert logs.returncode == 0 and "tokens" in logs.stdout

    # A second run redoes nothing and keeps the first run's logs.
    first_logs = sorted(stage_dir.glob("log-*.out"))
    before = prefix.with_suffix(".bin").stat().st_mtime_ns
    again = run_main(
        *overrides,
        "stages=[data_preparation]",
        "data_preparation.train_tokenizer_args.vocab_size=1000",
    )
    assert again.returncode == 0, again.stderr
    assert prefix.with_suffix(".bin").stat().st_mtime_ns == before
    assert set(first_logs) < set(stage_dir.glob("log-*.out"))
    assert len(list((results / "runs").iterdir())) == 2

    # Another vocabulary size: a new tokenizer, and the data tokenized with it.
    other = run_main(
        *overrides,
        "stages=[data_preparation]",
        "data_preparation.train_tokenizer_args.vocab_size=700",
    )
    assert other.returncode == 0, other.stderr
    logs = run_ops("logs", str(stage_dir)).stdout
    assert "settings changed (vocab_size 1000 -> 700): training" in logs
    assert "tokenizer changed: redoing tiny_corpus_text_document" in logs
    tokenizer = sentencepiece.SentencePieceProcessor(
        model_file=str(data / "custom_dataset" / "bpe" / "custom_sp_tokenizer.model")
    )
    assert tokenizer.get_piece_size() == 700
    dataset = IndexedDataset(str(prefix))
    assert dataset[1].tolist() == tokenizer.encode(texts[1]) + [tokenizer.eos_id()]


def test_the_sample_tokenizer_covers_its_corpus(prepared: Path) -> None:
    """A tokenizer that left characters of the sample corpus out made them the unknown token,
    and the default run's export check printed runs of "\u2047" (its decoded form)."""
    tokenizer = sentencepiece.SentencePieceProcessor(
        model_file=str(prepared / "data" / "custom_dataset" / "bpe" / "custom_sp_tokenizer.model")
    )
    texts = sample_texts()
    characters = sorted(set("".join(texts)))
    pieces = tokenizer.encode(characters)
    uncovered = [c for c, ids in zip(characters, pieces, strict=True) if tokenizer.unk_id() in ids]
    assert not uncovered
    assert all(tokenizer.unk_id() not in ids for ids in tokenizer.encode(texts))


def test_a_failing_job_stops_the_pipeline(tmp_path: Path) -> None:
    results, data = tmp_path / "results", tmp_path / "data"
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\nnot json\n{"no_text": 1}\n' * 10)
    result = run_main(
        f"base_results_dir={results}",
        f"data_dir={data}",
        "stages=[data_preparation]",
        f"data_preparation.raw_dataset_files=[{broken}]",
        f"data_preparation.train_tokenizer_args.input={SAMPLE}",
        "data_preparation.train_tokenizer_args.vocab_size=500",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert "custom_dataset-preprocess failed with exit code 1" in error
    log = next((results / "custom_dataset").glob("log-custom_dataset-preprocess_*.out"))
    assert str(log) in error
    assert "broken.jsonl:2" in log.read_text()
    assert job_states(results / "custom_dataset") == {
        "custom_dataset-train_tokenizer": "COMPLETED",
        "custom_dataset-preprocess": "FAILED",
    }
    status = run_ops("status", str(results / "custom_dataset"))
    assert f"see {log}" in status.stdout


def test_pile_recipe_downloads_extracts_and_tokenizes(site: Site, tmp_path: Path) -> None:
    tokenizer, shards = serve_pile(site, tmp_path)
    results, data = tmp_path / "results", tmp_path / "data"

    result = run_main(f"base_results_dir={results}", f"data_dir={data}", *pile_overrides(site))
    assert result.returncode == 0, result.stdout + result.stderr

    assert_pile_tokenized(data, tokenizer, shards)
    # rm_downloaded and rm_extracted leave only the tokenized shards and the tokenizer.
    assert not list(data.glob("*.zst")) and not list(data.glob("*.jsonl"))
    assert not list(data.glob("*.jsonl.meta.json"))  # the extracted files' records went too
    assert sorted(p.name for p in (data / "bpe").iterdir()) == [
        "merges.txt",
        "merges.txt.meta.json",
        "vocab.json",
        "vocab.json.meta.json",
    ]
    assert set(job_states(results).values()) == {"COMPLETED"}


def test_cancel_stops_a_running_job_and_the_rest_of_the_pipeline(
    site: Site, tmp_path: Path
) -> None:
    site.behaviour.files["00.jsonl.zst"] = zstandard.compress(b'{"text": "a"}\n' * 1000)
    site.behaviour.stall_after["00.jsonl.zst"] = 10
    # Until the test ends: a busy machine may take long to start the job and to cancel it.
    site.behaviour.stall_s = 3600
    results = tmp_path / "results"
    launcher = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "main.py"),
            f"base_results_dir={results}",
            f"data_dir={tmp_path / 'data'}",
            "stages=[data_preparation]",
            "data_preparation=gpt3/download_gpt3_pile",
            "data_preparation.file_numbers=0",
            "data_preparation.preprocess_data=false",
            f"data_preparation.the_pile_url={site.url}/",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 900
        while True:
            linked = (results / "download_gpt3_pile" / "run_manifest.json").exists()
            if linked and job_states(results).get("download_gpt3_pile-download") == "RUNNING":
                break
            if launcher.poll() is not None:
                pytest.fail("the launcher ended first: " + launcher.communicate()[1][-3000:])
            if time.monotonic() > deadline:
                pytest.fail("the download job did not start in 900 s")
            time.sleep(0.2)
        cancel = run_ops("cancel", str(results / "download_gpt3_pile"))
        assert cancel.returncode == 0, cancel.stderr
        assert "cancel requested: download_gpt3_pile-download" in cancel.stdout
        _, stderr = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    assert "was cancelled" in stderr
    assert job_states(results) == {
        "download_gpt3_pile-download": "CANCELLED",
        "download_gpt3_pile-extract": "CANCELLED",
    }


def test_status_reports_a_lost_launcher(tmp_path: Path) -> None:
    """A RUNNING job whose process is gone (machine rebooted, kill -9) is shown as LOST."""
    # Alive until the test kills it, however long the first status takes.
    sleeper = subprocess.Popen(["sleep", "3600"], start_new_session=True)
    write_run_manifest(
        tmp_path, {"name": "job", "job_ids": [f"local-{sleeper.pid}"], "pid": sleeper.pid}
    )
    assert job_states(tmp_path) == {"job": "RUNNING"}
    os.killpg(sleeper.pid, signal.SIGKILL)
    sleeper.wait()
    assert job_states(tmp_path) == {"job": "LOST"}


def test_launcher_root_is_the_checkout() -> None:
    assert Path(launcher_root()) == REPO
