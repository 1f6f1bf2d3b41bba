#!/usr/bin/env bash
# Stage export, job serve: rendered by launcher_scripts (Slurm backend).
#SBATCH --job-name=launcher:serve
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --time=4:00:00
#SBATCH --output=/results/gpt3_126m/export/slurm-serve_%j.out
#SBATCH --gpus-per-node=1
#SBATCH --mem=0
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
    --kill-on-bad-exit=1 python3 -u -m launcher_scripts.jobs.numa_binding \
    --mode=unique_contiguous \
    --scope=node \
    --cores=all_logical \
    --balanced=true \
    --min-cores=1 \
    --max-cores=8 \
    --local-ranks=1 \
    -- launcher_scripts.jobs.export.serve /results/gpt3_126m/export \
    --http-port=auto \
    --grpc-port=auto \
    --endpoint-file=/results/gpt3_126m/export/endpoint.json
