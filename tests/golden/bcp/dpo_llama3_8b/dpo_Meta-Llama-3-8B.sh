#!/usr/bin/env bash
# Stage dpo, job dpo_Meta-Llama-3-8B: rendered by launcher_scripts (BCP backend).
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
cd /results/Meta-Llama-3-8B/dpo

# shellcheck disable=SC2016  # expanded on each node
exec bcprun \
    --nnodes "$nodes" \
    --npernode 1 \
    --workdir /results/Meta-Llama-3-8B/dpo \
    --env "PYTHONPATH=$PYTHONPATH" \
    --env TORCH_NCCL_AVOID_RECORD_STREAMS=1 \
    --env TRANSFORMERS_OFFLINE=1 \
    --env TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120 \
    --env "MASTER_ADDR=$MASTER_ADDR" \
    --env "MASTER_PORT=$MASTER_PORT" \
    --env "LAUNCHER_NNODES=$nodes" \
    -c 'unset SLURM_ARRAY_TASK_ID SLURM_ARRAY_TASK_COUNT NGC_ARRAY_INDEX NGC_ARRAY_SIZE RANK WORLD_SIZE SLURM_PROCID SLURM_NTASKS LOCAL_RANK; exec python3 -u -m torch.distributed.run --standalone --nproc-per-node=8 -m launcher_scripts.jobs.numa_binding --mode=unique_contiguous --scope=node --cores=all_logical --balanced=true --min-cores=1 --max-cores=8 --local-ranks=8 -- launcher_scripts.jobs.fine_tuning.finetune --config /results/Meta-Llama-3-8B/dpo/dpo_Meta-Llama-3-8B_hydra.yaml --stage dpo'
