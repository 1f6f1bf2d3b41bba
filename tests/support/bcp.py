"""A stand-in for Base Command Platform's bcprun, for tests (there is no bcprun here).

It runs the `-c` command once per "node" in `--workdir` with the `--env` variables, every node a
process of this machine: the scripts' wiring is tested, not BCP's placement or networking.
"""

from __future__ import annotations

import os
from pathlib import Path

BCPRUN_SHIM = """#!/usr/bin/env bash
# A stand-in for bcprun, for tests: runs the -c command once per "node", all on this machine.
set -euo pipefail
nnodes=1 npernode=1 workdir=. cmd=
while [ $# -gt 0 ]; do
    case "$1" in
        --nnodes) nnodes=$2; shift 2 ;;
        --npernode) npernode=$2; shift 2 ;;
        --workdir) workdir=$2; shift 2 ;;
        --env) export "${2?}"; shift 2 ;;
        -c) cmd=$2; shift 2 ;;
        *) echo "bcprun shim: unknown option $1" >&2; exit 2 ;;
    esac
done
if [ "$npernode" != 1 ]; then
    echo "bcprun shim: runs one process per node only" >&2
    exit 2
fi
cd "$workdir"
# Each "node" is a process of this machine, with its own NGC_ARRAY_INDEX.
pids=()
for ((index = 0; index < nnodes; index++)); do
    NGC_ARRAY_INDEX=$index bash -c "$cmd" &
    pids+=("$!")
done
code=0
for pid in "${pids[@]}"; do
    wait "$pid" || code=$?
done
exit "$code"
"""


def install_bcprun(folder: Path) -> dict[str, str]:
    """The stand-in as `bcprun` in `folder`; the environment of node 0 of a one-replica BCP
    job with it on PATH (to set with monkeypatch)."""
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / "bcprun"
    shim.write_text(BCPRUN_SHIM)
    shim.chmod(0o755)
    return {
        "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}",
        "NGC_ARRAY_SIZE": "1",
        "NGC_ARRAY_INDEX": "0",
        "NGC_MASTER_ADDR": "127.0.0.1",
    }
