#!/usr/bin/env bash
# Stage evaluation, job eval_all_gpt3_126m: rendered by launcher_scripts (Slurm backend).
#SBATCH --job-name=launcher:eval_all_gpt3_126m
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --time=4:00:00
#SBATCH --output=/results/gpt3_126m/eval_all/slurm-eval_all_gpt3_126m_%j.out
#SBATCH --gpus-per-node=2
#SBATCH --mem=0
#SBATCH --exclusive
set -euo pipefail

export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export MASTER_ADDR MASTER_PORT
cd /results/gpt3_126m/eval_all

srun \
    --ntasks-per-node=2 \
    --kill-on-bad-exit=1 python3 -u -m launcher_scripts.jobs.numa_binding \
    --mode=unique_contiguous \
    --scope=node \
    --cores=all_logical \
    --balanced=true \
    --min-cores=1 \
    --max-cores=8 \
    --local-ranks=2 \
    -- launcher_scripts.jobs.evaluation.evaluate \
    --config /results/gpt3_126m/eval_all/eval_all_gpt3_126m_hydra.yaml
