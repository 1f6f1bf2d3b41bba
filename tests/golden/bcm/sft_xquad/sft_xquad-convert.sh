#!/usr/bin/env bash
# Stage data_preparation, job sft_xquad-convert: rendered by launcher_scripts (Slurm backend).
#SBATCH --job-name=launcher:sft_xquad-convert
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=1:00:00
#SBATCH --output=/results/sft_xquad/slurm-sft_xquad-convert_%j.out
#SBATCH --cpus-per-task=1
set -euo pipefail

export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export MASTER_ADDR MASTER_PORT
cd /results/sft_xquad

srun \
    --ntasks-per-node=1 \
    --kill-on-bad-exit=1 python3 -u -m launcher_scripts.jobs.data_prep.sft_convert squad \
    --input /data/squad_data/xquad/xquad.en.json \
    --text-to-text /data/squad_data/xquad/xquad.en_src.txt /data/squad_data/xquad/xquad.en_tgt.txt \
    --max-bad-fraction 0.01

srun \
    --ntasks-per-node=1 \
    --kill-on-bad-exit=1 python3 -u -m launcher_scripts.jobs.data_prep.sft_convert squad \
    --input /data/squad_data/xquad/xquad.es.json \
    --text-to-text /data/squad_data/xquad/xquad.es_src.txt /data/squad_data/xquad/xquad.es_tgt.txt \
    --max-bad-fraction 0.01

srun \
    --ntasks-per-node=1 \
    --kill-on-bad-exit=1 python3 -u -m launcher_scripts.jobs.data_prep.sft_convert squad \
    --input /data/squad_data/xquad/xquad.de.json \
    --text-to-text /data/squad_data/xquad/xquad.de_src.txt /data/squad_data/xquad/xquad.de_tgt.txt \
    --max-bad-fraction 0.01

srun \
    --ntasks-per-node=1 \
    --kill-on-bad-exit=1 python3 -u -m launcher_scripts.jobs.data_prep.sft_convert squad \
    --input /data/squad_data/xquad/xquad.hi.json \
    --text-to-text /data/squad_data/xquad/xquad.hi_src.txt /data/squad_data/xquad/xquad.hi_tgt.txt \
    --max-bad-fraction 0.01

srun \
    --ntasks-per-node=1 \
    --kill-on-bad-exit=1 python3 -u -m launcher_scripts.jobs.data_prep.sft_convert squad \
    --input /data/squad_data/xquad/xquad.zh.json \
    --text-to-text /data/squad_data/xquad/xquad.zh_src.txt /data/squad_data/xquad/xquad.zh_tgt.txt \
    --max-bad-fraction 0.01
