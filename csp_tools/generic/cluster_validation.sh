#!/usr/bin/env bash
# GPU diagnostics and a pairwise interconnect sweep on a Slurm partition's nodes; lists the
# nodes to drain. Settings: csp_tools/generic/validation.yaml. See --help.
#   bash csp_tools/generic/cluster_validation.sh --nodes=8 --nodelist=node-[0-7] --partition=gpu
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec python3 -m csp_tools.validation --csp="$(basename "$(dirname "${BASH_SOURCE[0]}")")" "$@"
