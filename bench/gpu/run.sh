#!/usr/bin/env bash
# The GPU suite, one command (docs/development.md, "The GPU suite"):
#
#   bash bench/gpu/run.sh [--rehearse] [--out DIR] [--keep] [--only STEP ...]
#
# On the GPU machine (no network): makes a venv with --system-site-packages (the machine's torch
# is kept) and installs the launcher's needs from the wheels in .whl/ (bench/gpu/fetch-wheels.sh
# fills it on a networked machine; without .whl/ the machine's python3 must have them); then runs
# bench/gpu/suite.py.
# Results: DIR (else $OUT, else a new folder under /tmp): summary.json, summary.md, logs.tar.gz.
# --rehearse: every step on CPU with tiny sizes, no install (this checkout's Python must have
# the launcher's needs).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
rehearse=0
args=()
while [ $# -gt 0 ]; do
  case $1 in
    --rehearse) rehearse=1; args+=(--rehearse) ;;
    --keep) args+=(--keep) ;;
    --out) [ $# -ge 2 ] || { echo "run.sh: --out needs a folder" >&2; exit 2; }
           args+=(--out "$2"); shift ;;
    --only) shift; args+=(--only "$@"); break ;;
    -h|--help) sed -n '2,12p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "run.sh: unknown argument $1 (--rehearse, --out DIR, --keep, --only STEP ...)" >&2; exit 2 ;;
  esac
  shift
done

# The launcher's needs (requirements.txt) and megatron-core, as modules to import.
needs="import hydra, omegaconf, numpy, orjson, tokenizers, gigatoken, sentencepiece, zstandard, tqdm, megatron.core"
python=python3
if [ "$rehearse" = 0 ]; then
  if [ -d "$repo/.whl" ]; then
    # The wheels are installed (again: pip passes over what is there) into a venv that keeps the
    # machine's own packages, torch first of all.
    venv=${GPU_SUITE_VENV:-$repo/.venv-gpu}
    [ -x "$venv/bin/python3" ] || python3 -m venv --system-site-packages "$venv"
    python=$venv/bin/python3
    # fetch-wheels.sh's list: exactly the wheels it fetched (the rest is on the machine)
    "$python" -m pip install --quiet --no-index --find-links "$repo/.whl" \
      -r "$repo/.whl/requirements.txt"
    # Wheels installed without their declared dependencies (lm-eval and its own needs)
    if [ -s "$repo/.whl/alone.txt" ]; then
      "$python" -m pip install --quiet --no-index --find-links "$repo/.whl" --no-deps \
        -r "$repo/.whl/alone.txt"
    fi
  fi
  if ! "$python" -c "$needs" 2>/dev/null; then
    echo "run.sh: the launcher's needs do not import with $python and there is no $repo/.whl: run bash bench/gpu/fetch-wheels.sh on a networked machine and copy .whl/ here" >&2
    exit 1
  fi
fi
cd "$repo"
exec "$python" bench/gpu/suite.py "${args[@]}"
