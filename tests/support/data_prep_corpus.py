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

from tests.support import REPO

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


def tricky_jsonl_lines(seed: int = 0) -> list[bytes]:
    """JSON lines where a reader can go wrong, shuffled among ordinary ones: escapes and
    surrogate pairs, raw UTF-8, text values that are not strings, broken JSON and broken
    UTF-8, odd whitespace and line structure (two objects on a line, one over two lines)."""
    texts = varied_texts(60, seed=seed)
    lines = [json.dumps({"id": n, "text": t}).encode() for n, t in enumerate(texts[:30])]
    raw_utf8 = [{"text": t, "meta": {"n": 1}} for t in texts[30:]]
    lines += [json.dumps(obj, ensure_ascii=False).encode() for obj in raw_utf8]
    lines += [
        b'{"text": "\\ud83d\\ude00 pair, \\u00e9 \\n\\t\\"\\\\\\/ escapes, \\u0000 nul"}',
        b'{"text": "lone \\ud800 high surrogate"}',
        b'{"text": "lone \\udc00 low surrogate"}',
        b'{"text": 17}', b'{"text": null}', b'{"text": ["a"]}', b'{"text": {"a": 1}}',
        b'{"text": true}', b'{"body": "no text key"}', b'["not", "an", "object"]',
        b'"a string"', b"42", b'{"text": "trailing comma",}', b"{not json}",
        b'{"text": "unterminated', b'{"text": "bad utf-8 \xff\xfe"}',
        b'{"text": "fine", "meta": "bad utf-8 \xc3\x28"}', b'{"text": "control \x01 char"}',
        b'{"text": "crlf line"}\r', b'   {"text": "padded"}   ', b"", b"  ", b"\t", b"\r",
        b'{"text": "two"} {"text": "on one line"}', b'{"text":\n"spanning two lines"}',
        b'\xef\xbb\xbf{"text": "after a byte order mark"}',
        b'{"text": "duplicate key", "text": "last one wins"}',
        b'{"text": "number out of range", "n": 1e999}',
        b'{"text": "deep", "x": ' + b"[" * 1100 + b"]" * 1100 + b"}",
        b'{"text": ""}', b'{"text": "' + b"a long line " * 3000 + b'"}',
    ]  # fmt: skip
    random.Random(seed).shuffle(lines)
    return lines


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


def run_job(
    module: str, *args: str | Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a data_prep job program as the launcher does: python3 -m <module> <args>."""
    return subprocess.run(
        [sys.executable, "-m", f"launcher_scripts.jobs.data_prep.{module}", *map(str, args)],
        cwd=REPO,
        env={**job_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
