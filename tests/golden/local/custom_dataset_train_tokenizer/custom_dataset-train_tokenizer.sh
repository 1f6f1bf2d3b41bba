#!/usr/bin/env bash
# Stage data_preparation, job custom_dataset-train_tokenizer: rendered by launcher_scripts (local backend).
# Run it again by hand with: bash <this file>
set -euo pipefail

# This job does all the work itself, whatever allocation it runs in.
unset SLURM_ARRAY_TASK_ID SLURM_ARRAY_TASK_COUNT NGC_ARRAY_INDEX NGC_ARRAY_SIZE RANK WORLD_SIZE SLURM_PROCID SLURM_NTASKS LOCAL_RANK
export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
cd /results/custom_dataset

exec python3 -u -m launcher_scripts.jobs.data_prep.train_tokenizer \
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
