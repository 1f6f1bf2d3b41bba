#!/usr/bin/env bash
# Stage data_preparation, job sft_squad-convert: rendered by launcher_scripts (local backend).
# Run it again by hand with: bash <this file>
set -euo pipefail

# This job does all the work itself, whatever allocation it runs in.
unset SLURM_ARRAY_TASK_ID SLURM_ARRAY_TASK_COUNT NGC_ARRAY_INDEX NGC_ARRAY_SIZE RANK WORLD_SIZE SLURM_PROCID SLURM_NTASKS LOCAL_RANK
export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
cd /results/sft_squad

python3 -u -m launcher_scripts.jobs.data_prep.sft_convert squad \
    --input /data/squad_data/v1.1/train-v1.1.json \
    --output /data/squad_data/v1.1/train-v1.1_gpt.json \
    --text-to-text /data/squad_data/v1.1/train-v1.1_src.txt /data/squad_data/v1.1/train-v1.1_tgt.txt \
    --max-bad-fraction 0.01

exec python3 -u -m launcher_scripts.jobs.data_prep.sft_convert squad \
    --input /data/squad_data/v1.1/dev-v1.1.json \
    --output /data/squad_data/v1.1/dev-v1.1_gpt.json \
    --text-to-text /data/squad_data/v1.1/dev-v1.1_src.txt /data/squad_data/v1.1/dev-v1.1_tgt.txt \
    --max-bad-fraction 0.01 \
    --all-answers
