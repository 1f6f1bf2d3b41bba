#!/usr/bin/env bash
# Stage dpo, job dpo_Meta-Llama-3-8B: rendered by launcher_scripts (local backend).
# Run it again by hand with: bash <this file>
set -euo pipefail

# This job does all the work itself, whatever allocation it runs in.
unset SLURM_ARRAY_TASK_ID SLURM_ARRAY_TASK_COUNT NGC_ARRAY_INDEX NGC_ARRAY_SIZE RANK WORLD_SIZE SLURM_PROCID SLURM_NTASKS LOCAL_RANK
export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120
cd /results/Meta-Llama-3-8B/dpo

exec python3 -u -m launcher_scripts.jobs.torchrun \
    --standalone \
    --nproc-per-node=8 -m launcher_scripts.jobs.numa_binding \
    --mode=unique_contiguous \
    --scope=node \
    --cores=all_logical \
    --balanced=true \
    --min-cores=1 \
    --max-cores=8 \
    --local-ranks=8 \
    -- launcher_scripts.jobs.fine_tuning.finetune \
    --config /results/Meta-Llama-3-8B/dpo/dpo_Meta-Llama-3-8B_hydra.yaml \
    --stage dpo
