"""The validation command checked before any step runs: a command Slurm would refuse, or a
results folder that cannot be written, is one line and exit 2, never a node in the verdict.

An srun that Slurm refuses (an unknown partition or node, a bad time limit, GPUs the nodes do
not have) fails on every node at once; counted as node failures, such a refusal would drain
healthy nodes through `cluster.exclude_unhealthy`. So the partition, the nodes and their GPUs
are read from `sinfo` first, and the steps' shape is then put to Slurm itself with
`srun --test-only`, which allocates nothing.
"""

from __future__ import annotations

import difflib
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

SLURM_COMMANDS = ("srun", "sinfo", "scontrol")

# Slurm's --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds, or no limit.
_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}")
_NO_LIMIT = ("INFINITE", "UNLIMITED")


class UsageError(ValueError):
    """One line: what is wrong with the command and how to fix it."""


def closest(word: str, known: Sequence[str]) -> str:
    """' (did you mean X?)' for the known word nearest `word`, else ''."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def shown(names: Sequence[str], most: int = 8) -> str:
    return ",".join(names[:most]) + (f",... ({len(names)} in all)" if len(names) > most else "")


def check_time_limit(text: str) -> None:
    if text.upper() in _NO_LIMIT or _TIME.fullmatch(text):
        return
    raise UsageError(
        f"--time-limit={text}: not a Slurm time limit; give minutes (30), HH:MM:SS or D-HH:MM:SS"
    )


def check_commands() -> None:
    lacking = [name for name in SLURM_COMMANDS if shutil.which(name) is None]
    if lacking:
        raise UsageError(
            f"Slurm's {', '.join(lacking)} {'is' if len(lacking) == 1 else 'are'} not on PATH: "
            "run this on a login node of the cluster, or add Slurm's bin folder to PATH"
        )


def check_results_dir(folder: Path) -> None:
    """The folder (or the nearest folder above it that exists) takes a file: tried with a
    temporary file, which is gone again at once, so a refused command leaves nothing."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(
            f"--results-dir={folder}: {existing} is not a folder; give a folder to write the "
            "results in"
        )
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise UsageError(
            f"--results-dir={folder}: cannot write in {existing} ({error.strerror}); give a "
            "folder you can write"
        ) from None


def _sinfo(*options: str) -> list[str]:
    listed = subprocess.run(["sinfo", "-h", *options], capture_output=True, text=True)
    if listed.returncode != 0:
        reason = listed.stderr.strip().splitlines()[-1:] or [f"exit {listed.returncode}"]
        raise UsageError(f"sinfo cannot read the cluster: {reason[0]}; is Slurm up?")
    return [line.strip() for line in listed.stdout.splitlines() if line.strip()]


def gpu_count(gres: str) -> int:
    """The GPUs in sinfo's %G of a node: 'gpu:8', 'gpu:h100:8(S:0-1)', '(null)' -> 0."""
    count = 0
    for item in gres.split(","):
        fields = re.sub(r"\(.*?\)", "", item).split(":")
        if fields[0] == "gpu" and len(fields) > 1 and fields[-1].isdigit():
            count += int(fields[-1])
    return count


def check_partition(partition: str, nodes: Sequence[str], gpus_per_node: int) -> None:
    """The partition exists, holds every listed node, and each node has the GPUs asked for."""
    partitions = sorted(set(_sinfo("--all", "-o", "%R")))
    if partition not in partitions:
        raise UsageError(
            f"--partition={partition}: no such partition{closest(partition, partitions)}; "
            f"sinfo shows {', '.join(partitions)}"
        )
    gres: dict[str, str] = {}
    for line in _sinfo("-N", "-p", partition, "-o", "%N|%G"):
        name, _, found = line.partition("|")
        gres[name] = found
    outside = [node for node in nodes if node not in gres]
    if outside:
        hint = closest(outside[0], sorted(gres))
        raise UsageError(
            f"--nodelist: {shown(outside)} {'is' if len(outside) == 1 else 'are'} not in "
            f"partition {partition}{hint}; its nodes are {shown(sorted(gres))} "
            f"(sinfo -N -p {partition})"
        )
    if gpus_per_node:
        short = [node for node in nodes if gpu_count(gres[node]) < gpus_per_node]
        if short:
            raise UsageError(
                f"--gpus-per-node={gpus_per_node}: Slurm's GRES of {shown(short)} is "
                f"{gres[short[0]]}, without {gpus_per_node} GPUs; give --gpus-per-node=0 on "
                "nodes without GPUs, or as many as the nodes have"
            )


def srun_reason(stderr: str, returncode: int) -> str:
    """srun's own words for a refusal: its last error line, else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(("srun: error:", "srun: fatal:"))]
    told = [line for line in lines if line.startswith("allocation failure:")]
    for line in reversed(errors + told):
        reason = re.sub(r"^(srun: (error|fatal): |allocation failure: )", "", line)
        if reason not in ("No error", ""):
            return reason
    return lines[-1] if lines else f"exit {returncode}"


def check_with_slurm(srun: Sequence[str], env: Mapping[str, str]) -> None:
    """The steps' srun as Slurm would take it (`srun --test-only`: checked, nothing run)."""
    tried = subprocess.run(
        [srun[0], "--test-only", *srun[1:]], capture_output=True, text=True, env=dict(env)
    )
    if tried.returncode != 0:
        raise UsageError(
            f"srun refuses the validation's steps: {srun_reason(tried.stderr, tried.returncode)}"
            "; fix the options (or the Slurm settings in the environment)"
        )
