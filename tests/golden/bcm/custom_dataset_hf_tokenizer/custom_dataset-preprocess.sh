#!/usr/bin/env bash
# Stage data_preparation, job custom_dataset-preprocess: rendered by launcher_scripts (Slurm backend).
#SBATCH --job-name=launcher:custom_dataset-preprocess
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=24:00:00
#SBATCH --output=/results/custom_dataset/slurm-custom_dataset-preprocess_%A_%a.out
#SBATCH --cpus-per-task=256
#SBATCH --array=0-1
set -euo pipefail

export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export MASTER_ADDR MASTER_PORT
cd /results/custom_dataset

srun \
    --ntasks-per-node=1 \
    --kill-on-bad-exit=1 python3 -u -m launcher_scripts.jobs.data_prep.preprocess \
    --input /data/raw/docs '/data/raw/it'"'"'s here.json' \
    --output-dir /data/custom_dataset/preprocessed \
    --text-key text \
    --tokenizer-model /data/tok/tokenizer.json \
    --workers 2 \
    --max-bad-fraction 0.01 \
    --no-append-eod
