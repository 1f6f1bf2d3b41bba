#!/usr/bin/env bash
# Stage data_preparation, job download_gpt3_pile-download: rendered by launcher_scripts (BCP backend).
# Run it on node 0 of a Base Command Platform job: bash <this file>
set -euo pipefail

export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
replicas="${NGC_ARRAY_SIZE:-1}"
# 5 array tasks, spread over the replicas; each process takes its share.
nodes=$(( replicas < 5 ? replicas : 5 ))
# Node 0, where this script runs, hosts the rendezvous.
MASTER_ADDR="${NGC_MASTER_ADDR:-$(hostname)}"
MASTER_PORT=29400
export MASTER_ADDR MASTER_PORT
cd /results/download_gpt3_pile

# shellcheck disable=SC2016  # expanded on each node
exec bcprun \
    --nnodes "$nodes" \
    --npernode 1 \
    --workdir /results/download_gpt3_pile \
    --env "PYTHONPATH=$PYTHONPATH" \
    --env TORCH_NCCL_AVOID_RECORD_STREAMS=1 \
    --env TRANSFORMERS_OFFLINE=1 \
    --env "MASTER_ADDR=$MASTER_ADDR" \
    --env "MASTER_PORT=$MASTER_PORT" \
    --env "LAUNCHER_NNODES=$nodes" \
    -c 'unset SLURM_ARRAY_TASK_ID SLURM_ARRAY_TASK_COUNT NGC_ARRAY_INDEX NGC_ARRAY_SIZE RANK WORLD_SIZE SLURM_PROCID SLURM_NTASKS LOCAL_RANK; exec python3 -u -m torch.distributed.run --nnodes="$LAUNCHER_NNODES" --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id=download_gpt3_pile-download --nproc-per-node=1 -m launcher_scripts.jobs.data_prep.download --url-base https://the-eye.eu/public/AI/pile/train/ --file-numbers 0,3,5-7 --name-format '"'"'{:02d}.jsonl.zst'"'"' --output-dir /data'
