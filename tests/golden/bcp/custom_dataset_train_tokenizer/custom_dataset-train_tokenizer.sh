#!/usr/bin/env bash
# Stage data_preparation, job custom_dataset-train_tokenizer: rendered by launcher_scripts (BCP backend).
# Run it on node 0 of a Base Command Platform job: bash <this file>
set -euo pipefail

export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
nodes=1
# Node 0, where this script runs, hosts the rendezvous.
MASTER_ADDR="${NGC_MASTER_ADDR:-$(hostname)}"
MASTER_PORT=29400
export MASTER_ADDR MASTER_PORT
cd /results/custom_dataset

# shellcheck disable=SC2016  # expanded on each node
exec bcprun \
    --nnodes "$nodes" \
    --npernode 1 \
    --workdir /results/custom_dataset \
    --env "PYTHONPATH=$PYTHONPATH" \
    --env TORCH_NCCL_AVOID_RECORD_STREAMS=1 \
    --env TRANSFORMERS_OFFLINE=1 \
    --env "MASTER_ADDR=$MASTER_ADDR" \
    --env "MASTER_PORT=$MASTER_PORT" \
    --env "LAUNCHER_NNODES=$nodes" \
    -c 'python3 -u -m launcher_scripts.jobs.data_prep.train_tokenizer --input /data/raw/a.jsonl /data/raw/b.jsonl.gz --text-key text --model-prefix /data/custom_dataset/bpe/custom_sp_tokenizer --input-format text --model-type bpe --vocab-size 8000 --character-coverage 1.0 --unk-id 1 --bos-id 2 --eos-id 3 --pad-id 0'
