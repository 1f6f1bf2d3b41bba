#!/usr/bin/env bash
# Stage rlhf_ppo, job rlhf_ppo_gpt3_tiny: rendered by launcher_scripts (local backend).
# Run it again by hand with: bash <this file>
set -euo pipefail

# This job does all the work itself, whatever allocation it runs in.
unset SLURM_ARRAY_TASK_ID SLURM_ARRAY_TASK_COUNT NGC_ARRAY_INDEX NGC_ARRAY_SIZE RANK WORLD_SIZE SLURM_PROCID SLURM_NTASKS LOCAL_RANK
export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120
cd /results/gpt3_tiny/rlhf_ppo

exec python3 -u -m launcher_scripts.jobs.fine_tuning.finetune \
    --config /results/gpt3_tiny/rlhf_ppo/rlhf_ppo_gpt3_tiny_hydra.yaml \
    --stage rlhf_ppo
