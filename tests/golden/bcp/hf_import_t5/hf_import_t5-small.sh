#!/usr/bin/env bash
# Stage conversion, job hf_import_t5-small: rendered by launcher_scripts (BCP backend).
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
cd /results/t5-small/convert_nemo

# shellcheck disable=SC2016  # expanded on each node
exec bcprun \
    --nnodes "$nodes" \
    --npernode 1 \
    --workdir /results/t5-small/convert_nemo \
    --env "PYTHONPATH=$PYTHONPATH" \
    --env TORCH_NCCL_AVOID_RECORD_STREAMS=1 \
    --env TRANSFORMERS_OFFLINE=1 \
    --env "MASTER_ADDR=$MASTER_ADDR" \
    --env "MASTER_PORT=$MASTER_PORT" \
    --env "LAUNCHER_NNODES=$nodes" \
    -c 'python3 -u -m launcher_scripts.jobs.conversion.hf_import --config /results/t5-small/convert_nemo/hf_import_t5-small_hydra.yaml'
