#!/usr/bin/env bash
# Stage conversion, job convert_bert_tiny: rendered by launcher_scripts (Slurm backend).
#SBATCH --job-name=launcher:convert_bert_tiny
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=2:00:00
#SBATCH --output=/results/bert_tiny/convert_nemo/slurm-convert_bert_tiny_%j.out
set -euo pipefail

export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export MASTER_ADDR MASTER_PORT
cd /results/bert_tiny/convert_nemo

srun \
    --ntasks-per-node=1 \
    --kill-on-bad-exit=1 python3 -u -m launcher_scripts.jobs.conversion.convert \
    --config /results/bert_tiny/convert_nemo/convert_bert_tiny_hydra.yaml
