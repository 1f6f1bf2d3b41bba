#!/usr/bin/env bash
# Stage data_preparation, job custom_dataset-train_tokenizer: rendered by launcher_scripts (Slurm backend).
#SBATCH --job-name=launcher:custom_dataset-train_tokenizer
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=24:00:00
#SBATCH --output=/results/custom_dataset/slurm-custom_dataset-train_tokenizer_%j.out
#SBATCH --cpus-per-task=256
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
    --kill-on-bad-exit=1 python3 -u -m launcher_scripts.jobs.data_prep.train_tokenizer \
    --input /data/raw/a.jsonl /data/raw/b.jsonl.gz \
    --text-key text \
    --model-prefix /data/custom_dataset/bpe/custom_sp_tokenizer \
    --input-format text \
    --model-type bpe \
    --vocab-size 8000 \
    --character-coverage 1.0 \
    --unk-id 1 \
    --bos-id 2 \
    --eos-id 3 \
    --pad-id 0
