#!/usr/bin/env bash
# Stage conversion, job hf_import_t5-small: rendered by launcher_scripts (Slurm backend).
#SBATCH --job-name=launcher:hf_import_t5-small
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=2:00:00
#SBATCH --output=/results/t5-small/convert_nemo/slurm-hf_import_t5-small_%j.out
set -euo pipefail

export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export MASTER_ADDR MASTER_PORT
cd /results/t5-small/convert_nemo

srun \
    --ntasks-per-node=1 \
    --kill-on-bad-exit=1 python3 -u -m launcher_scripts.jobs.conversion.hf_import \
    --config /results/t5-small/convert_nemo/hf_import_t5-small_hydra.yaml
