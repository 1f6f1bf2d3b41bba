"""The curation jobs' shared ground: the work folder's layout, which units of work (logical
tasks, bucket partitions) this array task owns, and running them on its worker processes.

Every unit is finished or absent: a unit's outputs are written under a hidden name and
renamed into place last, so a rerun (after a kill, a failed node, a requeue) redoes exactly
the units whose outputs are missing. The units, not the nodes, decide the output: the same
recipe on one process or on an array of nodes writes the same files.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from launcher_scripts.curation.recipe import CurationRecipe, read_curation
from launcher_scripts.errors import ConfigError, JobError
from launcher_scripts.files import replaced_directory, replaced_file, write_atomic
from launcher_scripts.formats.shards import rank_and_world_size, share
from launcher_scripts.jobs.refusal import refuse

STAGE = "data_curation"
EXACT_BAND = np.uint32(0xFFFFFFFF)  # the band of the exact-dedup key
BAND_RECORD = np.dtype(
    [("key", "<u8"), ("key2", "<u8"), ("band", "<u4"), ("task", "<u4"), ("doc", "<u4")]
)
EDGE_COLUMNS = 4  # task, doc, task, doc (uint32)


@dataclass(frozen=True)
class Work:
    """Where each phase writes, under the recipe's work_dir."""

    root: Path

    def documents(self, task: int) -> Path:
        return self.root / "documents" / f"{task:05d}"

    def kept(self, task: int) -> Path:
        return self.documents(task) / "kept.jsonl.zst"

    def signatures(self, task: int) -> Path:
        return self.documents(task) / "signatures.u32"

    def shingles(self, task: int) -> Path:
        return self.documents(task) / "shingles.u64"

    def shingle_offsets(self, task: int) -> Path:
        return self.documents(task) / "shingles.idx"

    def bands(self, task: int, partition: int) -> Path:
        return self.documents(task) / "bands" / f"{partition:04d}.bin"

    def document_stats(self, task: int) -> Path:
        return self.documents(task) / "stats.json"

    def edges(self, partition: int) -> Path:
        return self.root / "buckets" / f"{partition:04d}.npy"

    def bucket_stats(self, partition: int) -> Path:
        return self.root / "buckets" / f"{partition:04d}.json"

    @property
    def components(self) -> Path:
        return self.root / "components"

    def removed(self, task: int) -> Path:
        return self.components / "removed" / f"{task:05d}.npy"

    @property
    def clusters(self) -> Path:
        return self.components / "clusters.json"

    def written(self, task: int) -> Path:
        return self.root / "written" / f"{task:05d}.json"


@contextlib.contextmanager
def unit_folder(target: Path) -> Iterator[Path]:
    """A folder to fill that replaces `target` whole when the block ends; the partial folders
    a killed earlier attempt left beside it are removed first."""
    if target.parent.is_dir():
        for stale in target.parent.glob(f".{target.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
    with replaced_directory(target) as folder:
        yield folder


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def write_json(path: Path, value: Any) -> None:
    write_atomic(path, json.dumps(value, indent=1, sort_keys=True))


def save_array(path: Path, array: np.ndarray) -> None:
    with replaced_file(path) as temporary:
        np.save(temporary, array)


def load_recipe(config: str) -> tuple[DictConfig, CurationRecipe]:
    cfg = OmegaConf.load(config)
    assert isinstance(cfg, DictConfig)
    return cfg, read_curation(cfg, STAGE)


# A unit's work: (config file, unit index) -> a line for the log. Module-level functions, so
# worker processes can run them.
Unit = Callable[[str, int], str]


def run_units(
    argv: list[str] | None,
    description: str,
    units: Callable[[CurationRecipe], int],
    done: Callable[[Work, int], Path] | None,
    unit: Unit,
) -> int:
    """The program of one phase: this array task's share of the phase's units, each not yet
    done run on the node's worker processes; one line per unit. `done`: the file whose
    existence marks a unit finished; None for a phase redone every time."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="the data_curation stage's resolved config")
    parser.add_argument("--workers", type=int, default=1, help="processes on this node")
    args = parser.parse_args(argv)
    try:
        cfg, recipe = load_recipe(args.config)
        rank, world = rank_and_world_size()
        work = Work(recipe.work_dir)
        mine = share(range(units(recipe)), rank, world)
        todo = [index for index in mine if done is None or not done(work, index).exists()]
        skipped = len(mine) - len(todo)
        print(
            f"task {rank} of {world} on {socket.gethostname()}: units {list(mine) or 'none'}"
            + (f" ({skipped} done before, skipped)" if skipped else ""),
            flush=True,
        )
        started = time.monotonic()
        if args.workers > 1 and len(todo) > 1:
            context = multiprocessing.get_context("fork")
            with context.Pool(min(args.workers, len(todo))) as pool:
                for line in pool.imap_unordered(_call, [(unit, args.config, i) for i in todo]):
                    print(line, flush=True)
        else:
            for index in todo:
                print(unit(args.config, index), flush=True)
        print(f"task {rank}: {len(todo)} units in {time.monotonic() - started:.1f} s", flush=True)
    except (ConfigError, JobError) as error:
        return refuse(error)
    except ModuleNotFoundError as error:
        return refuse(
            f"data_curation's jobs need the package {error.name}, which this environment "
            "lacks: pip install 'llm-launcher[curation]' where the jobs run (the container, or "
            "this machine for the local backend)"
        )
    return 0


def _call(job: tuple[Unit, str, int]) -> str:
    unit, config, index = job
    return unit(config, index)


def main_exit(code: int) -> None:
    sys.exit(code)
