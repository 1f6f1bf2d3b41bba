"""Tokenizing one huge one-line document against the same text as ordinary documents.

    python3 bench/long_document.py [--size-mb 50] [--workdir DIR]

Writes the same text twice as JSONL: once as a single document of --size-mb MB on one line,
once cut at spaces into documents of about 2 kB; trains a small SentencePiece tokenizer on a
sample of it; times `python3 -m launcher_scripts.jobs.data_prep.preprocess --workers 1` on
each in a fresh process; checks that the long document's tokens are the ordinary documents'
tokens joined (a cut at a space keeps the ids); and prints the ratio of the long document's
throughput to the ordinary documents'. Before long documents were encoded in pieces
(launcher_scripts/formats/long_documents.py) the ratio was about 0.2 at 4 MB and fell with
the size (a tenth at 50 MB). Other work on the machine makes the numbers unreliable: the
load average is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMON = ("the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with")


def text_of(size: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocabulary = [
        "".join(rng.choice(letters) for _ in range(rng.randint(3, 10))) for _ in range(5000)
    ]
    words: list[str] = []
    length = 0
    while length < size:
        word = rng.choice(vocabulary) if rng.random() < 0.6 else rng.choice(COMMON)
        if rng.random() < 0.05:
            word = word.capitalize() + rng.choice(".,;")
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:size].rstrip()


def documents_of(text: str, size: int) -> list[str]:
    """`text` cut at spaces into documents of about `size` characters."""
    documents, start = [], 0
    while start < len(text):
        end = text.find(" ", start + size)
        end = len(text) if end < 0 else end
        documents.append(text[start:end].strip())
        start = end + 1
    return documents


def timed_job(data: Path, out: Path, model: Path) -> float:
    started = time.perf_counter()
    subprocess.run(
        [
            sys.executable, "-m", "launcher_scripts.jobs.data_prep.preprocess", "--input",
            str(data), "--output-dir", str(out), "--tokenizer-model", str(model), "--workers", "1",
        ],
        check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=50)
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    import numpy as np
    import sentencepiece
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    work = args.workdir or Path(tempfile.mkdtemp(prefix="long_document_"))
    work.mkdir(parents=True, exist_ok=True)
    text = text_of(int(args.size_mb * 1e6))
    documents = documents_of(text, 2000)
    inputs = {"many": work / "many.jsonl", "one": work / "one.jsonl"}
    inputs["one"].write_text(json.dumps({"text": text}) + "\n")
    inputs["many"].write_text("".join(json.dumps({"text": doc}) + "\n" for doc in documents))
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(documents[:2000]), model_prefix=str(work / "sp"),
        vocab_size=4000, model_type="bpe", character_coverage=1.0, minloglevel=2,
    )  # fmt: skip
    model = work / "sp.model"
    seconds = {name: timed_job(path, work / name, model) for name, path in inputs.items()}
    tokens = {name: IndexedDataset(str(work / name / f"{name}_text_document")) for name in inputs}
    joined = np.concatenate([tokens["many"][i][:-1] for i in range(len(tokens["many"]))])
    identical = np.array_equal(tokens["one"][0][:-1], joined)
    megabytes = len(text.encode()) / 1e6
    labels = {"many": f"{len(documents)} documents of ~2 kB", "one": "one document"}
    for name, label in labels.items():
        print(f"{label:>28}: {seconds[name]:7.2f} s  {megabytes / seconds[name]:6.2f} MB/s")
    print(f"tokens identical: {identical}")
    ratio = seconds["many"] / seconds["one"]
    print(f"ratio (one document / ordinary documents, throughput): {ratio:.2f}")
    print(f"load average: {os.getloadavg()[0]:.1f}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
