#!/usr/bin/env bash
# Stage data_curation, job curate_jsonl-prepare: rendered by launcher_scripts (local backend).
# Run it again by hand with: bash <this file>
set -euo pipefail

# This job does all the work itself, whatever allocation it runs in.
unset SLURM_ARRAY_TASK_ID SLURM_ARRAY_TASK_COUNT NGC_ARRAY_INDEX NGC_ARRAY_SIZE RANK WORLD_SIZE SLURM_PROCID SLURM_NTASKS LOCAL_RANK
export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
cd /results/curate_jsonl

exec python3 -u -m launcher_scripts.jobs.curation.prepare \
    --config /results/curate_jsonl/curate_jsonl_hydra.yaml
