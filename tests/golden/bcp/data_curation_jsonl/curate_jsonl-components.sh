#!/usr/bin/env bash
# Stage data_curation, job curate_jsonl-components: rendered by launcher_scripts (BCP backend).
# Run it on node 0 of a Base Command Platform job: bash <this file>
set -euo pipefail

export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
nodes=1
# Node 0, where this script runs, hosts the rendezvous.
MASTER_ADDR="${NGC_MASTER_ADDR:-$(hostname)}"
MASTER_PORT=29400
export MASTER_ADDR MASTER_PORT
cd /results/curate_jsonl

# shellcheck disable=SC2016  # expanded on each node
exec bcprun \
    --nnodes "$nodes" \
    --npernode 1 \
    --workdir /results/curate_jsonl \
    --env "PYTHONPATH=$PYTHONPATH" \
    --env TORCH_NCCL_AVOID_RECORD_STREAMS=1 \
    --env TRANSFORMERS_OFFLINE=1 \
    --env "MASTER_ADDR=$MASTER_ADDR" \
    --env "MASTER_PORT=$MASTER_PORT" \
    --env "LAUNCHER_NNODES=$nodes" \
    -c 'python3 -u -m launcher_scripts.jobs.curation.components --config /results/curate_jsonl/curate_jsonl_hydra.yaml'
