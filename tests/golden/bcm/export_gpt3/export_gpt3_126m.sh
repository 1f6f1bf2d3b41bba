#!/usr/bin/env bash
# Stage export, job export_gpt3_126m: rendered by launcher_scripts (Slurm backend).
#SBATCH --job-name=launcher:export_gpt3_126m
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=1:00:00
#SBATCH --output=/results/gpt3_126m/export/slurm-export_gpt3_126m_%j.out
set -euo pipefail

export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export MASTER_ADDR MASTER_PORT
cd /results/gpt3_126m/export

srun \
    --ntasks-per-node=1 \
    --kill-on-bad-exit=1 python3 -u -m launcher_scripts.jobs.export.export \
    --config /results/gpt3_126m/export/export_gpt3_126m_hydra.yaml
