#!/usr/bin/env bash
# The GPU suite, one command (docs/development.md, "The GPU suite"):
#
#   bash bench/gpu/run.sh [--rehearse] [--out DIR] [--keep] [--only STEP ...]
#
# On the GPU machine (no network): makes a venv with --system-site-packages (the machine's torch
# is kept) and installs the launcher's needs from the wheels in .whl/ (bench/gpu/fetch-wheels.sh
# fills it on a networked machine), unless they import already; then runs bench/gpu/suite.py.
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
if [ "$rehearse" = 0 ] && ! python3 -c "$needs" 2>/dev/null; then
  venv=${GPU_SUITE_VENV:-$repo/.venv-gpu}
  [ -x "$venv/bin/python3" ] || python3 -m venv --system-site-packages "$venv"
  python=$venv/bin/python3
  if ! "$python" -c "$needs" 2>/dev/null; then
    if [ ! -d "$repo/.whl" ]; then
      echo "run.sh: no $repo/.whl: run bash bench/gpu/fetch-wheels.sh on a networked machine and copy it here" >&2
      exit 1
    fi
    # fetch-wheels.sh's list: exactly the wheels it fetched (the rest is on the machine)
    "$python" -m pip install --quiet --no-index --find-links "$repo/.whl" \
      -r "$repo/.whl/requirements.txt"
    # Wheels whose checked parts need none of their declared dependencies (lm-eval's adapter)
    if [ -s "$repo/.whl/alone.txt" ]; then
      "$python" -m pip install --quiet --no-index --find-links "$repo/.whl" --no-deps \
        -r "$repo/.whl/alone.txt"
    fi
    "$python" -c "$needs"
  fi
fi
cd "$repo"
exec "$python" bench/gpu/suite.py "${args[@]}"
