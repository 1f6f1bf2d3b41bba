#!/usr/bin/env bash
# Stage data_preparation, job download_mc4-download: rendered by launcher_scripts (Slurm backend).
#SBATCH --job-name=launcher:download_mc4-download
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=24:00:00
#SBATCH --output=/results/download_mc4/slurm-download_mc4-download_%A_%a.out
#SBATCH --array=0-19
set -euo pipefail

export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export MASTER_ADDR MASTER_PORT
cd /results/download_mc4

srun \
    --ntasks-per-node=1 \
    --kill-on-bad-exit=1 python3 -u -m launcher_scripts.jobs.data_prep.mc4 download \
    --languages cs:1024,da:1024 \
    --cleaned-english \
    --c4-dir /data/mc4/c4 \
    --url-base https://huggingface.co/datasets/allenai/c4/resolve/main \
    --output-dir /data/mc4/preprocessed \
    --tokenizer-model /data/mc4/bpe/mt5_tokenizer.model
