"""The shipped sample corpus, and a Pile-like download served by the test site."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import zstandard
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tokenizers import ByteLevelBPETokenizer

from tests.support import REPO
from tests.support.http_site import Site

SAMPLE = REPO / "launcher_scripts" / "sample_data" / "tiny_corpus.jsonl.gz"


def sample_texts() -> list[str]:
    with gzip.open(SAMPLE, "rt") as lines:
        return [json.loads(line)["text"] for line in lines]


def gpt2_tokenizer_files(folder: Path, texts: list[str]) -> ByteLevelBPETokenizer:
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(texts, vocab_size=600, special_tokens=["<|endoftext|>"])
    folder.mkdir(parents=True)
    tokenizer.save_model(str(folder))
    return tokenizer


def serve_pile(site: Site, folder: Path) -> tuple[ByteLevelBPETokenizer, dict[int, list[str]]]:
    """Two Pile-like shards and a GPT-2 style tokenizer on the test site."""
    texts = sample_texts()[:200]
    shards = {0: texts[:120], 1: texts[120:]}
    for number, docs in shards.items():
        jsonl = "".join(
            json.dumps({"text": t, "meta": {"pile_set_name": "x"}}) + "\n" for t in docs
        )
        site.behaviour.files[f"{number:02d}.jsonl.zst"] = zstandard.compress(jsonl.encode())
    tokenizer = gpt2_tokenizer_files(folder / "bpe_source", texts)
    for name in ("vocab.json", "merges.txt"):
        site.behaviour.files[name] = (folder / "bpe_source" / name).read_bytes()
    return tokenizer, shards


def pile_overrides(site: Site) -> tuple[str, ...]:
    return (
        "stages=[data_preparation]",
        "data_preparation=gpt3/download_gpt3_pile",
        "data_preparation.file_numbers='0-1'",
        f"data_preparation.the_pile_url={site.url}/",
        f"data_preparation.download_vocab_url={site.url}/vocab.json",
        f"data_preparation.download_merges_url={site.url}/merges.txt",
    )


def assert_pile_tokenized(
    data: Path, tokenizer: ByteLevelBPETokenizer, shards: dict[int, list[str]]
) -> None:
    eod = tokenizer.token_to_id("<|endoftext|>")
    for number, docs in shards.items():
        dataset = IndexedDataset(str(data / f"my-gpt3_{number:02d}_text_document"))
        assert len(dataset) == len(docs)
        assert dataset[5].tolist() == tokenizer.encode(docs[5]).ids + [eod]
