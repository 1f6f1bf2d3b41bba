#!/usr/bin/env bash
# Stage data_preparation, job download_t5_pile-download: rendered by launcher_scripts (Slurm backend).
#SBATCH --job-name=launcher:download_t5_pile-download
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=4:00:00
#SBATCH --output=/results/download_t5_pile/slurm-download_t5_pile-download_%A_%a.out
#SBATCH --array=0-1
set -euo pipefail

export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export MASTER_ADDR MASTER_PORT
cd /results/download_t5_pile

srun \
    --ntasks-per-node=1 \
    --kill-on-bad-exit=1 python3 -u -m launcher_scripts.jobs.data_prep.download \
    --url-base https://the-eye.eu/public/AI/pile/train/ \
    --file-numbers 0,3 \
    --name-format '{:02d}.jsonl.zst' \
    --output-dir /data
