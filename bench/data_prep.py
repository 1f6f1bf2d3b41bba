"""Benchmark the data-preparation tokenize job against the raw speed of its tokenizer engines.

    python3 bench/data_prep.py [--size-mb 60] [--workdir DIR] [--repeat 3]

In one run it
  1. generates a deterministic English-like JSONL corpus of --size-mb MB (Zipf-distributed
     vocabulary, punctuation, capitals, paragraphs, numbers, a sprinkle of unicode and emoji),
  2. trains a ~32k byte-level BPE tokenizer.json on a small sample with `tokenizers`,
  3. times `python3 -m launcher_scripts.jobs.data_prep.preprocess` end to end as a subprocess
     (interpreter start-up included) with --workers 1 and 2,
  4. times the raw batch encode of `tokenizers` and of gigatoken on the same texts held in
     memory, on 1 and 2 threads, each in a fresh process (cold caches, like the job), and
     checks that both engines produce identical ids,
then prints a table and the ratio "end-to-end with 2 workers / fastest identical engine raw
on 2 threads" against the target 0.8.

Throughput is in MB of document text (UTF-8 bytes of the "text" fields) per second for every
row, so end-to-end and raw rows compare the same quantity. Each time is the median of
--repeat runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SEED = 20240611
TARGET = 0.8

# fmt: off
COMMON = (
    "the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be",
    "by", "on", "not", "he", "I", "this", "are", "or", "his", "from", "at", "which", "but",
    "have", "an", "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has",
    "there", "been", "if", "more", "when", "will", "would", "who", "so", "no", "she", "other",
    "its", "may", "these", "about", "into", "only", "some", "could", "them", "than", "then",
    "also", "after", "first", "two", "most", "over", "such", "new", "like", "between", "during",
    "however", "people", "time", "year", "way", "day", "man", "thing", "woman", "life", "child",
    "world", "school", "state", "family", "student", "group", "country", "problem", "hand",
    "part", "place", "case", "week", "company", "system", "program", "question", "work",
    "government", "number", "night", "point", "home", "water", "room", "mother", "area", "money",
    "story", "fact", "month", "lot", "right", "study", "book", "eye", "job", "word", "business",
    "issue", "side", "kind", "head", "house", "service", "friend", "father", "power", "hour",
    "game", "line", "end", "member", "law", "car", "city", "community", "name", "president",
    "team", "minute", "idea", "kid", "body", "information", "back", "parent", "face", "others",
    "level", "office", "door", "health", "person", "art", "war", "history", "party", "result",
    "change", "morning", "reason", "research", "girl", "guy", "moment", "air", "teacher", "force",
    "education",
)
ONSETS = ("", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v",
          "w", "br", "cr", "dr", "fl", "gr", "pl", "pr", "sc", "sh", "sl", "sp", "st", "str", "th",
          "tr", "wh", "ch", "qu")
NUCLEI = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "oo", "ou", "y", "ie")
CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "d", "ng", "nd", "st", "rt", "ck", "x", "th",
         "sh", "nt", "ble", "tion", "ment", "ness", "ing", "ed", "er", "ly")
UNICODE = ("café", "naïve", "Zürich", "résumé", "façade", "Ελλάδα", "Москва", "東京", "北京大学",
           "😀", "🚀", "👍🏽", "—", "“quoted”", "±", "€100", "ß", "São Paulo", "Dvořák", "…")
# fmt: on
SUFFIXES = ("", ".", ",", ";", ":", "?", "!", ".\n\n", "'s")
SUFFIX_P = (0.81, 0.075, 0.07, 0.008, 0.008, 0.008, 0.006, 0.01, 0.005)


# ---- corpus --------------------------------------------------------------------------------


def make_vocabulary(rng: np.random.Generator, size: int) -> list[str]:
    """Common English words first (the most frequent ranks), then pronounceable inventions."""
    words = dict.fromkeys(COMMON)
    while len(words) < size:
        syllables = int(rng.choice([1, 2, 3], p=[0.45, 0.42, 0.13]))
        word = "".join(
            ONSETS[rng.integers(len(ONSETS))]
            + NUCLEI[rng.integers(len(NUCLEI))]
            + CODAS[rng.integers(len(CODAS))]
            for _ in range(syllables)
        )
        words.setdefault(word, None)
    return list(words)


def make_token_table(rng: np.random.Generator) -> tuple[np.ndarray, int, int]:
    """All token strings: each word with each suffix (and capitalised), numbers, unicode."""
    words = make_vocabulary(rng, 60_000)
    variants = []
    for word in words:
        for suffix in SUFFIXES:
            variants.append(word + suffix)
            variants.append(word.capitalize() + suffix)
    numbers = [str(int(n)) for n in rng.integers(0, 10 ** rng.integers(1, 7, 20_000))]
    numbers += [f"{x:.2f}" for x in rng.random(2_000) * 1000]
    table = np.array(variants + numbers + list(UNICODE), dtype=object)
    return table, len(words), len(numbers)


def generate_corpus(path: Path, size_mb: float, seed: int = SEED) -> None:
    rng = np.random.default_rng(seed)
    table, word_count, number_count = make_token_table(rng)
    zipf = 1.0 / np.arange(1, word_count + 1) ** 1.05
    zipf /= zipf.sum()
    target = int(size_mb * 1e6)
    written = 0
    doc_id = 0
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        while written < target:
            lengths = np.clip(rng.lognormal(6.0, 0.8, 2000).astype(int), 20, 20_000)
            n = int(lengths.sum())
            word = rng.choice(word_count, n, p=zipf)
            suffix = rng.choice(len(SUFFIXES), n, p=SUFFIX_P)
            capital = rng.random(n) < 0.06
            index = (word * len(SUFFIXES) + suffix) * 2 + capital
            kind = rng.random(n)
            index = np.where(kind < 0.03, 2 * len(SUFFIXES) * word_count
                             + rng.integers(0, number_count, n), index)  # fmt: skip
            index = np.where(kind > 0.995, len(table) - len(UNICODE)
                             + rng.integers(0, len(UNICODE), n), index)  # fmt: skip
            tokens = table[index].tolist()
            start = 0
            for length in lengths.tolist():
                text = " ".join(tokens[start : start + length])
                start += length
                line = json.dumps(
                    {"id": doc_id, "url": f"https://example.org/page/{doc_id}", "text": text},
                    ensure_ascii=False,
                )
                out.write(line + "\n")
                written += len(line.encode("utf-8")) + 1
                doc_id += 1
                if written >= target:
                    break
    os.replace(tmp, path)


def read_texts(path: Path) -> list[str]:
    import orjson

    with open(path, "rb") as stream:
        return [orjson.loads(line)["text"] for line in stream]


def train_tokenizer(corpus: Path, target: Path, vocab_size: int, sample_mb: float) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sample: list[str] = []
    size = 0
    for text in read_texts(corpus):
        sample.append(text)
        size += len(text)
        if size > sample_mb * 1e6:
            break
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(sample, trainer)
    tokenizer.save(str(target))


# ---- measurements --------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    threads: int
    seconds: float
    text_mb: float
    tokens: int
    note: str = ""

    @property
    def mb_s(self) -> float:
        return self.text_mb / self.seconds

    @property
    def tokens_s(self) -> float:
        return self.tokens / self.seconds


def raw_encode(engine: str, corpus: Path, tokenizer_json: Path) -> dict:
    """Runs in a fresh process with RAYON_NUM_THREADS set: time one batch encode of all texts."""
    threads = int(os.environ["RAYON_NUM_THREADS"])
    texts = read_texts(corpus)
    digest = hashlib.blake2b(digest_size=16)
    if engine == "tokenizers":
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tokenizer_json))
        start = time.perf_counter()
        encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        seconds = time.perf_counter() - start
        ids = [encoding.ids for encoding in encodings]
        lengths = np.array([len(row) for row in ids], dtype=np.int64)
        flat = np.fromiter((t for row in ids for t in row), np.uint32, int(lengths.sum()))
    else:
        import awkward  # noqa: F401  (imported by the batch call anyway; not part of the timing)
        import gigatoken

        tokenizer = gigatoken.Tokenizer(str(tokenizer_json))
        start = time.perf_counter()
        result = tokenizer.encode_batch(texts, parallel=threads > 1)
        seconds = time.perf_counter() - start
        flat = np.asarray(result.layout.content.data, dtype=np.uint32)
        lengths = np.diff(np.asarray(result.layout.offsets.data))
    digest.update(lengths.astype(np.int64).tobytes())
    digest.update(flat.astype(np.uint32).tobytes())
    text_mb = sum(len(text.encode("utf-8")) for text in texts) / 1e6
    return {"seconds": seconds, "tokens": int(flat.size), "text_mb": text_mb,
            "digest": digest.hexdigest()}  # fmt: skip


def measure_raw(engine: str, threads: int, corpus: Path, tokenizer_json: Path) -> dict:
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")
    command = [sys.executable, __file__, "--raw", engine, str(corpus), str(tokenizer_json)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"raw {engine} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


SUMMARY = re.compile(r"summary: (\d+) documents, (\d+) tokens, .* in ([\d.]+) s")


def measure_job(workers: int, corpus: Path, tokenizer_json: Path, out: Path) -> tuple[float, dict]:
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [
        sys.executable, "-m", "launcher_scripts.jobs.data_prep.preprocess",
        "--input", str(corpus), "--output-dir", str(out),
        "--tokenizer-model", str(tokenizer_json), "--workers", str(workers),
    ]  # fmt: skip
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"preprocess failed:\n{result.stdout}\n{result.stderr}")
    match = SUMMARY.search(result.stdout)
    if not match:
        raise SystemExit(f"no summary line in:\n{result.stdout}")
    engine = re.search(r"engine (\w+)", result.stdout)
    return seconds, {
        "documents": int(match.group(1)),
        "tokens": int(match.group(2)),
        "job_seconds": float(match.group(3)),
        "engine": engine.group(1) if engine else "?",
    }


def median_job(workers: int, repeat: int, corpus: Path, tok: Path, out: Path, mb: float) -> Row:
    runs = [measure_job(workers, corpus, tok, out) for _ in range(repeat)]
    seconds = statistics.median(run[0] for run in runs)
    info = runs[0][1]
    job_seconds = statistics.median(run[1]["job_seconds"] for run in runs)
    note = f"engine {info['engine']}; {job_seconds:.2f} s after imports; tokens incl. EOD"
    return Row(f"preprocess --workers {workers}", workers, seconds, mb, info["tokens"], note)


def median_raw(engine: str, threads: int, repeat: int, corpus: Path, tok: Path) -> tuple[Row, str]:
    runs = [measure_raw(engine, threads, corpus, tok) for _ in range(repeat)]
    seconds = statistics.median(run["seconds"] for run in runs)
    first = runs[0]
    row = Row(f"raw {engine} batch encode", threads, seconds, first["text_mb"], first["tokens"])
    return row, first["digest"]


# ---- report --------------------------------------------------------------------------------


def print_table(rows: list[Row]) -> None:
    header = f"{'measurement':<34} {'threads':>7} {'seconds':>8} {'MB/s':>8} {'Mtok/s':>7}  note"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row.name:<34} {row.threads:>7} {row.seconds:>8.2f} {row.mb_s:>8.1f} "
            f"{row.tokens_s / 1e6:>7.2f}  {row.note}"
        )


def run_bench(args: argparse.Namespace, workdir: Path) -> None:
    corpus = workdir / f"corpus_{args.size_mb:g}mb_seed{SEED}.jsonl"
    tok = workdir / f"tokenizer_{args.vocab_size}.json"
    started = time.perf_counter()
    if not corpus.exists():
        generate_corpus(corpus, args.size_mb)
        print(f"generated {corpus} in {time.perf_counter() - started:.1f} s")
    if not tok.exists():
        train_tokenizer(corpus, tok, args.vocab_size, args.sample_mb)
    texts = read_texts(corpus)
    text_mb = sum(len(text.encode("utf-8")) for text in texts) / 1e6
    print(
        f"corpus: {corpus.stat().st_size / 1e6:.1f} MB JSONL, {len(texts)} documents, "
        f"{text_mb:.1f} MB of text; tokenizer: {tok.name}, vocab {args.vocab_size}; "
        f"{os.cpu_count()} CPUs; median of {args.repeat}\n"
    )
    del texts
    rows = [median_job(w, args.repeat, corpus, tok, workdir / "out", text_mb) for w in (1, 2)]
    digests: dict[str, str] = {}
    raw: dict[tuple[str, int], Row] = {}
    for engine in ("tokenizers", "gigatoken"):
        for threads in (1, 2):
            row, digest = median_raw(engine, threads, args.repeat, corpus, tok)
            raw[engine, threads] = row
            digests.setdefault(engine, digest)
            if digest != digests[engine]:
                raise SystemExit(f"{engine} gave different ids on 1 and 2 threads")
            rows.append(row)
    identical = {engine for engine in digests if digests[engine] == digests["tokenizers"]}
    for (engine, _), row in raw.items():
        row.note = "ids identical to tokenizers" if engine in identical else "ids DIFFER"
    print_table(rows)
    best = max((raw[engine, 2] for engine in identical), key=lambda row: row.mb_s)
    ratio = rows[1].mb_s / best.mb_s
    print(
        f"\nend-to-end with 2 workers / fastest identical engine raw on 2 threads "
        f"({best.name.split()[1]}): {rows[1].mb_s:.1f} / {best.mb_s:.1f} MB/s = {ratio:.2f} "
        f"(target {TARGET}: {'met' if ratio >= TARGET else 'NOT met'})"
    )
    command = f"python3 bench/data_prep.py --size-mb {args.size_mb:g} --repeat {args.repeat}"
    print(f"reproduce: {command}  (from {REPO}; total bench time "
          f"{time.perf_counter() - started:.0f} s)")  # fmt: skip


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--raw":
        engine, corpus, tokenizer_json = sys.argv[2:5]
        print(json.dumps(raw_encode(engine, Path(corpus), Path(tokenizer_json))))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=60.0, help="corpus size (default 60)")
    parser.add_argument("--workdir", type=Path, help="keep corpus and tokenizer here for reuse")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (median)")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--sample-mb", type=float, default=4.0, help="tokenizer training text")
    args = parser.parse_args()
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
        run_bench(args, args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="data_prep_bench_") as tmp:
            run_bench(args, Path(tmp))


if __name__ == "__main__":
    main()
