#!/usr/bin/env bash
# Stage conversion, job hf_import_t5-small: rendered by launcher_scripts (local backend).
# Run it again by hand with: bash <this file>
set -euo pipefail

# This job does all the work itself, whatever allocation it runs in.
unset SLURM_ARRAY_TASK_ID SLURM_ARRAY_TASK_COUNT NGC_ARRAY_INDEX NGC_ARRAY_SIZE RANK WORLD_SIZE SLURM_PROCID SLURM_NTASKS LOCAL_RANK
export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
cd /results/t5-small/convert_nemo

exec python3 -u -m launcher_scripts.jobs.conversion.hf_import \
    --config /results/t5-small/convert_nemo/hf_import_t5-small_hydra.yaml
