#!/usr/bin/env bash
# Stage data_preparation, job sft_dolly-convert: rendered by launcher_scripts (Slurm backend).
#SBATCH --job-name=launcher:sft_dolly-convert
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=1:00:00
#SBATCH --output=/results/sft_dolly/slurm-sft_dolly-convert_%j.out
#SBATCH --cpus-per-task=1
set -euo pipefail

export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export MASTER_ADDR MASTER_PORT
cd /results/sft_dolly

srun \
    --ntasks-per-node=1 \
    --kill-on-bad-exit=1 python3 -u -m launcher_scripts.jobs.data_prep.sft_convert dolly \
    --input /data/dolly/databricks-dolly-15k.jsonl \
    --split train 0.9 /data/dolly/dolly_train.jsonl \
    --split validation 0.05 /data/dolly/dolly_validation.jsonl \
    --split test 0.05 /data/dolly/dolly_test.jsonl \
    --seed 1234 \
    --max-bad-fraction 0.01
