#!/usr/bin/env bash
# Stage data_preparation, job sft_xquad-convert: rendered by launcher_scripts (local backend).
# Run it again by hand with: bash <this file>
set -euo pipefail

# This job does all the work itself, whatever allocation it runs in.
unset SLURM_ARRAY_TASK_ID SLURM_ARRAY_TASK_COUNT NGC_ARRAY_INDEX NGC_ARRAY_SIZE RANK WORLD_SIZE SLURM_PROCID SLURM_NTASKS LOCAL_RANK
export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
cd /results/sft_xquad

python3 -u -m launcher_scripts.jobs.data_prep.sft_convert squad \
    --input /data/squad_data/xquad/xquad.en.json \
    --text-to-text /data/squad_data/xquad/xquad.en_src.txt /data/squad_data/xquad/xquad.en_tgt.txt \
    --max-bad-fraction 0.01

python3 -u -m launcher_scripts.jobs.data_prep.sft_convert squad \
    --input /data/squad_data/xquad/xquad.es.json \
    --text-to-text /data/squad_data/xquad/xquad.es_src.txt /data/squad_data/xquad/xquad.es_tgt.txt \
    --max-bad-fraction 0.01

python3 -u -m launcher_scripts.jobs.data_prep.sft_convert squad \
    --input /data/squad_data/xquad/xquad.de.json \
    --text-to-text /data/squad_data/xquad/xquad.de_src.txt /data/squad_data/xquad/xquad.de_tgt.txt \
    --max-bad-fraction 0.01

python3 -u -m launcher_scripts.jobs.data_prep.sft_convert squad \
    --input /data/squad_data/xquad/xquad.hi.json \
    --text-to-text /data/squad_data/xquad/xquad.hi_src.txt /data/squad_data/xquad/xquad.hi_tgt.txt \
    --max-bad-fraction 0.01

exec python3 -u -m launcher_scripts.jobs.data_prep.sft_convert squad \
    --input /data/squad_data/xquad/xquad.zh.json \
    --text-to-text /data/squad_data/xquad/xquad.zh_src.txt /data/squad_data/xquad/xquad.zh_tgt.txt \
    --max-bad-fraction 0.01
