#!/usr/bin/env bash
# Stage data_preparation, job sft_dolly-convert: rendered by launcher_scripts (local backend).
# Run it again by hand with: bash <this file>
set -euo pipefail

# This job does all the work itself, whatever allocation it runs in.
unset SLURM_ARRAY_TASK_ID SLURM_ARRAY_TASK_COUNT NGC_ARRAY_INDEX NGC_ARRAY_SIZE RANK WORLD_SIZE SLURM_PROCID SLURM_NTASKS LOCAL_RANK
export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
cd /results/sft_dolly

exec python3 -u -m launcher_scripts.jobs.data_prep.sft_convert dolly \
    --input /data/dolly/databricks-dolly-15k.jsonl \
    --split train 0.9 /data/dolly/dolly_train.jsonl \
    --split validation 0.05 /data/dolly/dolly_validation.jsonl \
    --split test 0.05 /data/dolly/dolly_test.jsonl \
    --seed 1234 \
    --max-bad-fraction 0.01
