"""Small generated corpora and tokenizers for the data-preparation job tests (no downloads)."""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parents[1]
EOD = "<|endoftext|>"

# fmt: off
_WORDS = (
    "the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be",
    "by", "on", "not", "he", "I", "this", "are", "or", "his", "from", "at", "which", "but",
    "have", "an", "had", "they", "you", "were", "their", "one", "all", "we", "can", "her",
    "has", "there", "been", "if", "more", "when", "model", "data", "training", "tokenizer",
    "river", "mountain", "history", "energy", "music", "century", "population", "café",
    "naïve", "Zürich", "résumé", "Ελλάδα", "Москва", "東京", "北京", "مرحبا", "שלום", "हिन्दी",
)
_ODDITIES = (
    "😀", "🚀🚀", "\U0001f468\u200d\U0001f469\u200d\U0001f467", "🇫🇷", "—", "“quoted”", "€",
    "ß", "\u00a0", "\u200b", "\t", "\t\t", "   ", "\n", "\n\n\n", "\r\n", "12345", "3.14159",
    "-42", "1,000,000", "0x1F", EOD, "</s>", "<s>", "don't", "I'm", "they'll", "!!!", "...",
    "a_b_c", "CamelCase",
)
# fmt: on


def varied_texts(count: int, seed: int = 0) -> list[str]:
    """Documents mixing words, numbers, unicode, emoji, whitespace runs, newlines and
    special-token strings: the places where tokenizer implementations tend to differ."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        pieces = []
        for _ in range(rng.randint(1, 60)):
            pieces.append(rng.choice(_ODDITIES) if rng.random() < 0.2 else rng.choice(_WORDS))
            pieces.append(rng.choice((" ", " ", " ", "", "  ", ", ", ". ", "\n")))
        texts.append("".join(pieces))
    return texts


def write_jsonl(path: Path, texts: Iterable[str], key: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as stream:
        for number, text in enumerate(texts):
            stream.write(json.dumps({"id": number, key: text, "meta": {"n": number}}) + "\n")
    return path


def write_text_dir(folder: Path, texts: Sequence[str]) -> list[Path]:
    """One file per text, nested two levels deep; returns the files in sorted path order."""
    files = []
    for number, text in enumerate(texts):
        path = folder / f"group{number % 3}" / f"doc{number:04d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        files.append(path)
    return sorted(files)


def train_byte_level_bpe(texts: Sequence[str], vocab_size: int = 800) -> Tokenizer:
    """A GPT-2-style byte-level BPE with the end-of-text token, trained on `texts`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def save_tokenizer_files(tokenizer: Tokenizer, folder: Path) -> tuple[Path, Path, Path]:
    """tokenizer.json, and the GPT-2 vocab.json + merges.txt of the same model."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer_json = folder / "tokenizer.json"
    tokenizer.save(str(tokenizer_json))
    vocab, merges = tokenizer.model.save(str(folder))
    return tokenizer_json, Path(vocab), Path(merges)


def job_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for name in ("SLURM_ARRAY_TASK_ID", "NGC_ARRAY_INDEX", "RANK", "SLURM_PROCID"):
        env.pop(name, None)
    return env


def run_job(module: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """Run a data_prep job program as the launcher does: python3 -m <module> <args>."""
    return subprocess.run(
        [sys.executable, "-m", f"launcher_scripts.jobs.data_prep.{module}", *map(str, args)],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
