"""Corpora the data_curation tests make, with what is true of them known: planted near-
duplicates whose exact Jaccard similarity is computed here, independently of the launcher's
MinHash; and the launcher's overrides to curate them into a test's own folders."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from launcher_scripts.formats.shards import RANK_VARIABLES
from tests.support import REPO

SYLLABLES = [a + b for a in "bcdfghklmnprstvz" for b in ("a", "e", "i", "o", "u", "ai", "ou")]


def vocabulary(rng: random.Random, size: int) -> list[str]:
    words: set[str] = set()
    while len(words) < size:
        words.add("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4))))
    return sorted(words)


def mutated(
    rng: random.Random, words: list[str], fraction: float, vocab: Sequence[str]
) -> list[str]:
    """`words` with `fraction` of its positions given another word."""
    copy = list(words)
    for position in rng.sample(range(len(copy)), round(fraction * len(copy))):
        copy[position] = rng.choice(vocab)
    return copy


def planted_corpus(
    seed: int, bases: int, fractions: Sequence[float], length: tuple[int, int] = (120, 300)
) -> list[str]:
    """`bases` random documents, each with one variant per fraction of words replaced (0.0:
    an exact copy), shuffled. Unrelated documents share no 5-gram in practice (a 20,000-word
    vocabulary)."""
    rng = random.Random(seed)
    vocab = vocabulary(rng, 20000)
    texts = []
    for _ in range(bases):
        words = [rng.choice(vocab) for _ in range(rng.randint(*length))]
        texts.append(words)
        texts += [mutated(rng, words, fraction, vocab) for fraction in fractions]
    rng.shuffle(texts)
    return [" ".join(words) for words in texts]


def shingles(text: str, n: int) -> set[tuple[str, ...]]:
    words = text.lower().split()
    return {tuple(words[i : i + n]) for i in range(max(1, len(words) - n + 1))}


def true_removals(texts: Sequence[str], threshold: float, n: int) -> set[int]:
    """The documents exact dedup by Jaccard >= threshold removes: every pair sharing a shingle
    is compared exactly; in each connected component the first document (lowest index) is
    kept."""
    sets = [shingles(t, n) for t in texts]
    holders: dict[tuple[str, ...], list[int]] = {}
    for index, items in enumerate(sets):
        for shingle in items:
            holders.setdefault(shingle, []).append(index)
    parent = list(range(len(texts)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    compared: set[tuple[int, int]] = set()
    for indexes in holders.values():
        for a_position, a in enumerate(indexes):
            for b in indexes[a_position + 1 :]:
                if (a, b) in compared:
                    continue
                compared.add((a, b))
                if len(sets[a] & sets[b]) / len(sets[a] | sets[b]) >= threshold:
                    ra, rb = root(a), root(b)
                    parent[max(ra, rb)] = min(ra, rb)
    return {i for i in range(len(texts)) if root(i) != i}


def write_shards(folder: Path, texts: Sequence[str], shards: int) -> list[Path]:
    """The texts in `shards` JSONL files, in contiguous runs (file k holds the k-th run), each
    record's id its index in `texts`; the order of (file, line) is the order of `texts`."""
    folder.mkdir(parents=True, exist_ok=True)
    paths, size = [], -(-len(texts) // shards)
    for shard in range(shards):
        path = folder / f"shard_{shard:03d}.jsonl"
        with path.open("w", encoding="utf-8") as stream:
            for index in range(shard * size, min((shard + 1) * size, len(texts))):
                stream.write(json.dumps({"id": index, "text": texts[index]}) + "\n")
        paths.append(path)
    return paths


def curate_overrides(root: Path, files: Iterable[Path], *extra: str) -> list[str]:
    """A data_curation run of `files` into `root`: its data, work, output and results."""
    listed = ",".join(f'"{p}"' for p in files)
    return [
        "stages=[data_curation]",
        f"data_dir={root}/data",
        f"base_results_dir={root}/results",
        f"data_curation.source.files=[{listed}]",
        f"data_curation.work_dir={root}/work",
        f"data_curation.output_dir={root}/curated",
        *extra,
    ]


def output_records(folder: Path) -> list[dict]:
    """Every record of the JSONL shards under `folder`, sorted by id (order-independent)."""
    records = [
        json.loads(line)
        for path in sorted(folder.rglob("*.jsonl"))
        for line in path.read_text(encoding="utf-8").splitlines()
    ]
    return sorted(records, key=lambda r: str(r["id"]))


def output_ids(folder: Path) -> set[int]:
    return {int(r["id"]) for r in output_records(folder)}


# Plain English prose for the filter and language tests: sentences of common words, varied
# enough that no rule of the published set fires on them.
_DETERMINERS = ["The", "A", "This", "Every", "One", "That", "Our", "Their"]
_ADJECTIVES = [
    "small",
    "old",
    "quiet",
    "bright",
    "early",
    "late",
    "green",
    "heavy",
    "simple",
    "careful",
    "narrow",
    "broad",
    "warm",
    "cold",
    "local",
    "public",
    "strange",
    "famous",
    "gentle",
    "patient",
    "busy",
    "honest",
    "rural",
    "modern",
]
_NOUNS = [
    "teacher",
    "river",
    "village",
    "market",
    "garden",
    "doctor",
    "window",
    "letter",
    "farmer",
    "engine",
    "student",
    "bridge",
    "kitchen",
    "forest",
    "library",
    "painter",
    "station",
    "harbor",
    "museum",
    "council",
    "orchard",
    "baker",
    "tailor",
    "sailor",
    "author",
    "valley",
    "meadow",
    "chapel",
    "factory",
    "soldier",
    "merchant",
    "island",
    "castle",
    "wagon",
    "lantern",
    "ferry",
    "tower",
    "clerk",
    "miner",
    "shepherd",
    "pilot",
    "nurse",
    "printer",
]
_VERBS = [
    "watched",
    "carried",
    "found",
    "opened",
    "painted",
    "visited",
    "repaired",
    "described",
    "followed",
    "measured",
    "cleaned",
    "answered",
    "collected",
    "noticed",
    "borrowed",
    "crossed",
    "guarded",
    "admired",
    "sketched",
    "weighed",
    "counted",
    "praised",
]
_ENDINGS = (
    "before the storm arrived",
    "after the long winter",
    "because the road was closed",
    "while the children slept",
    "with great care",
    "during the busy season",
    "near the edge of town",
    "for the first time in years",
    "as the sun went down",
    "without saying a word",
    "on a cold morning",
    "under a grey sky",
    "at the end of the day",
    "in the old part of the city",
    "long after midnight",
    "despite the heavy rain",
)


def english_sentence(rng: random.Random) -> str:
    return (
        f"{rng.choice(_DETERMINERS)} {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} "
        f"{rng.choice(_VERBS)} the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} and the "
        f"{rng.choice(_NOUNS)} {rng.choice(_ENDINGS)}."
    )


def english_document(rng: random.Random, sentences: int = 12, per_line: int = 3) -> str:
    """Prose in lines of `per_line` sentences (so every line ends a sentence, as C4 wants)."""
    said = [english_sentence(rng) for _ in range(sentences)]
    return "\n".join(" ".join(said[i : i + per_line]) for i in range(0, sentences, per_line))


PHASES = ("prepare", "documents", "buckets", "components", "write", "report")


def phase_command(
    config: Path, phase: str, rank: int | None = None, world: int | None = None, workers: int = 1
) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of one data_curation job program on the stage's resolved config, as
    array task `rank` of `world` (None: the only task), as a scheduler would start it."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    if rank is not None:
        env |= {"RANK": str(rank), "WORLD_SIZE": str(world)}
    args = ["--config", str(config)]
    if phase in ("documents", "buckets", "write"):
        args += ["--workers", str(workers)]
    return [sys.executable, "-m", f"launcher_scripts.jobs.curation.{phase}", *args], env


def run_phase(
    config: Path, phase: str, rank: int | None = None, world: int | None = None, workers: int = 1
) -> subprocess.CompletedProcess:
    """One data_curation job program (phase_command) run to its end."""
    argv, env = phase_command(config, phase, rank, world, workers)
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)


def stage_config(root: Path) -> Path:
    return root / "results" / "curate_jsonl" / "curate_jsonl_hydra.yaml"


def mixed_corpus(seed: int, bases: int) -> list[str]:
    """Prose that passes the filters, planted duplicates, and junk that does not."""
    rng = random.Random(seed)
    prose = [english_document(rng) for _ in range(bases)]
    texts = prose + [text.replace(". ", ".  ") for text in prose[: bases // 4]]
    texts += [text + " " + english_document(rng, 1) for text in prose[: bases // 3]]
    texts += ["Click here. Buy now."] * 5 + planted_corpus(seed, bases // 10, (0.0,))
    rng.shuffle(texts)
    return texts


def output_files(root: Path) -> dict[str, str]:
    """The files a run under `root` wrote to its output folder, by path, with their text."""
    return {
        str(p.relative_to(root / "curated")): p.read_text()
        for p in sorted((root / "curated").rglob("*"))
        if p.is_file()
    }
