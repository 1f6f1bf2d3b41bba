#!/usr/bin/env bash
# Stage data_preparation, job download_t5_pile-download_tokenizer: rendered by launcher_scripts (Slurm backend).
#SBATCH --job-name=launcher:download_t5_pile-download_tokenizer
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=4:00:00
#SBATCH --output=/results/download_t5_pile/slurm-download_t5_pile-download_tokenizer_%j.out
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
    --file https://huggingface.co/bert-large-cased/resolve/main/vocab.txt /data/bpe/vocab.txt
