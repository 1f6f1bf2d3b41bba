#!/usr/bin/env bash
# Stage data_preparation, job sft_xquad-convert: rendered by launcher_scripts (BCP backend).
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
cd /results/sft_xquad

# shellcheck disable=SC2016  # expanded on each node
bcprun \
    --nnodes "$nodes" \
    --npernode 1 \
    --workdir /results/sft_xquad \
    --env "PYTHONPATH=$PYTHONPATH" \
    --env TORCH_NCCL_AVOID_RECORD_STREAMS=1 \
    --env TRANSFORMERS_OFFLINE=1 \
    --env "MASTER_ADDR=$MASTER_ADDR" \
    --env "MASTER_PORT=$MASTER_PORT" \
    --env "LAUNCHER_NNODES=$nodes" \
    -c 'python3 -u -m launcher_scripts.jobs.data_prep.sft_convert squad --input /data/squad_data/xquad/xquad.en.json --text-to-text /data/squad_data/xquad/xquad.en_src.txt /data/squad_data/xquad/xquad.en_tgt.txt --max-bad-fraction 0.01'

# shellcheck disable=SC2016  # expanded on each node
bcprun \
    --nnodes "$nodes" \
    --npernode 1 \
    --workdir /results/sft_xquad \
    --env "PYTHONPATH=$PYTHONPATH" \
    --env TORCH_NCCL_AVOID_RECORD_STREAMS=1 \
    --env TRANSFORMERS_OFFLINE=1 \
    --env "MASTER_ADDR=$MASTER_ADDR" \
    --env "MASTER_PORT=$MASTER_PORT" \
    --env "LAUNCHER_NNODES=$nodes" \
    -c 'python3 -u -m launcher_scripts.jobs.data_prep.sft_convert squad --input /data/squad_data/xquad/xquad.es.json --text-to-text /data/squad_data/xquad/xquad.es_src.txt /data/squad_data/xquad/xquad.es_tgt.txt --max-bad-fraction 0.01'

# shellcheck disable=SC2016  # expanded on each node
bcprun \
    --nnodes "$nodes" \
    --npernode 1 \
    --workdir /results/sft_xquad \
    --env "PYTHONPATH=$PYTHONPATH" \
    --env TORCH_NCCL_AVOID_RECORD_STREAMS=1 \
    --env TRANSFORMERS_OFFLINE=1 \
    --env "MASTER_ADDR=$MASTER_ADDR" \
    --env "MASTER_PORT=$MASTER_PORT" \
    --env "LAUNCHER_NNODES=$nodes" \
    -c 'python3 -u -m launcher_scripts.jobs.data_prep.sft_convert squad --input /data/squad_data/xquad/xquad.de.json --text-to-text /data/squad_data/xquad/xquad.de_src.txt /data/squad_data/xquad/xquad.de_tgt.txt --max-bad-fraction 0.01'

# shellcheck disable=SC2016  # expanded on each node
bcprun \
    --nnodes "$nodes" \
    --npernode 1 \
    --workdir /results/sft_xquad \
    --env "PYTHONPATH=$PYTHONPATH" \
    --env TORCH_NCCL_AVOID_RECORD_STREAMS=1 \
    --env TRANSFORMERS_OFFLINE=1 \
    --env "MASTER_ADDR=$MASTER_ADDR" \
    --env "MASTER_PORT=$MASTER_PORT" \
    --env "LAUNCHER_NNODES=$nodes" \
    -c 'python3 -u -m launcher_scripts.jobs.data_prep.sft_convert squad --input /data/squad_data/xquad/xquad.hi.json --text-to-text /data/squad_data/xquad/xquad.hi_src.txt /data/squad_data/xquad/xquad.hi_tgt.txt --max-bad-fraction 0.01'

# shellcheck disable=SC2016  # expanded on each node
exec bcprun \
    --nnodes "$nodes" \
    --npernode 1 \
    --workdir /results/sft_xquad \
    --env "PYTHONPATH=$PYTHONPATH" \
    --env TORCH_NCCL_AVOID_RECORD_STREAMS=1 \
    --env TRANSFORMERS_OFFLINE=1 \
    --env "MASTER_ADDR=$MASTER_ADDR" \
    --env "MASTER_PORT=$MASTER_PORT" \
    --env "LAUNCHER_NNODES=$nodes" \
    -c 'python3 -u -m launcher_scripts.jobs.data_prep.sft_convert squad --input /data/squad_data/xquad/xquad.zh.json --text-to-text /data/squad_data/xquad/xquad.zh_src.txt /data/squad_data/xquad/xquad.zh_tgt.txt --max-bad-fraction 0.01'
