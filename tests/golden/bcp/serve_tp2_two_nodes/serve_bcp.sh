#!/usr/bin/env bash
# Stage export, job serve: rendered by launcher_scripts (BCP backend).
# Run it on node 0 of a Base Command Platform job: bash <this file>
set -euo pipefail

export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
replicas="${NGC_ARRAY_SIZE:-1}"
nodes=2
if [ "$nodes" -gt "$replicas" ]; then
    echo 'launcher: job serve needs 2 nodes but this BCP job has '"${replicas}"' replicas (NGC_ARRAY_SIZE); start it with --replicas 2 or more' >&2
    exit 1
fi
# Node 0, where this script runs, hosts the rendezvous.
MASTER_ADDR="${NGC_MASTER_ADDR:-$(hostname)}"
MASTER_PORT=29400
export MASTER_ADDR MASTER_PORT
cd /results/gpt3_126m/export

# shellcheck disable=SC2016  # expanded on each node
exec bcprun \
    --nnodes "$nodes" \
    --npernode 1 \
    --workdir /results/gpt3_126m/export \
    --env "PYTHONPATH=$PYTHONPATH" \
    --env TORCH_NCCL_AVOID_RECORD_STREAMS=1 \
    --env TRANSFORMERS_OFFLINE=1 \
    --env "MASTER_ADDR=$MASTER_ADDR" \
    --env "MASTER_PORT=$MASTER_PORT" \
    --env "LAUNCHER_NNODES=$nodes" \
    -c 'unset SLURM_ARRAY_TASK_ID SLURM_ARRAY_TASK_COUNT NGC_ARRAY_INDEX NGC_ARRAY_SIZE RANK WORLD_SIZE SLURM_PROCID SLURM_NTASKS LOCAL_RANK; exec python3 -u -m torch.distributed.run --nnodes="$LAUNCHER_NNODES" --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id=serve --nproc-per-node=1 -m launcher_scripts.jobs.numa_binding --mode=unique_contiguous --scope=node --cores=all_logical --balanced=true --min-cores=1 --max-cores=8 --local-ranks=1 -- launcher_scripts.jobs.export.serve /results/gpt3_126m/export --http-port=auto --grpc-port=auto --endpoint-file=/results/gpt3_126m/export/endpoint.json'
