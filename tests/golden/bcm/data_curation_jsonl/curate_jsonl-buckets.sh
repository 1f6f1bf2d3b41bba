#!/usr/bin/env bash
# Stage data_curation, job curate_jsonl-buckets: rendered by launcher_scripts (Slurm backend).
#SBATCH --job-name=launcher:curate_jsonl-buckets
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=4:00:00
#SBATCH --output=/results/curate_jsonl/slurm-curate_jsonl-buckets_%A_%a.out
#SBATCH --array=0-3
set -euo pipefail

export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export MASTER_ADDR MASTER_PORT
cd /results/curate_jsonl

srun \
    --ntasks-per-node=1 \
    --kill-on-bad-exit=1 python3 -u -m launcher_scripts.jobs.curation.buckets \
    --config /results/curate_jsonl/curate_jsonl_hydra.yaml \
    --workers 2
