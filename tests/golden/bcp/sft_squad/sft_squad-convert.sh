#!/usr/bin/env bash
# Stage data_preparation, job sft_squad-convert: rendered by launcher_scripts (BCP backend).
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
cd /results/sft_squad

# shellcheck disable=SC2016  # expanded on each node
bcprun \
    --nnodes "$nodes" \
    --npernode 1 \
    --workdir /results/sft_squad \
    --env "PYTHONPATH=$PYTHONPATH" \
    --env TORCH_NCCL_AVOID_RECORD_STREAMS=1 \
    --env TRANSFORMERS_OFFLINE=1 \
    --env "MASTER_ADDR=$MASTER_ADDR" \
    --env "MASTER_PORT=$MASTER_PORT" \
    --env "LAUNCHER_NNODES=$nodes" \
    -c 'python3 -u -m launcher_scripts.jobs.data_prep.sft_convert squad --input /data/squad_data/v1.1/train-v1.1.json --output /data/squad_data/v1.1/train-v1.1_gpt.json --text-to-text /data/squad_data/v1.1/train-v1.1_src.txt /data/squad_data/v1.1/train-v1.1_tgt.txt --max-bad-fraction 0.01'

# shellcheck disable=SC2016  # expanded on each node
exec bcprun \
    --nnodes "$nodes" \
    --npernode 1 \
    --workdir /results/sft_squad \
    --env "PYTHONPATH=$PYTHONPATH" \
    --env TORCH_NCCL_AVOID_RECORD_STREAMS=1 \
    --env TRANSFORMERS_OFFLINE=1 \
    --env "MASTER_ADDR=$MASTER_ADDR" \
    --env "MASTER_PORT=$MASTER_PORT" \
    --env "LAUNCHER_NNODES=$nodes" \
    -c 'python3 -u -m launcher_scripts.jobs.data_prep.sft_convert squad --input /data/squad_data/v1.1/dev-v1.1.json --output /data/squad_data/v1.1/dev-v1.1_gpt.json --text-to-text /data/squad_data/v1.1/dev-v1.1_src.txt /data/squad_data/v1.1/dev-v1.1_tgt.txt --max-bad-fraction 0.01 --all-answers'
