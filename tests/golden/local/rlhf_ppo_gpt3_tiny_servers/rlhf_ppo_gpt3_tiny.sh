#!/usr/bin/env bash
# Stage rlhf_ppo, job rlhf_ppo_gpt3_tiny: rendered by launcher_scripts (local backend).
# Run it again by hand with: bash <this file>
set -euo pipefail

# This job does all the work itself, whatever allocation it runs in.
unset SLURM_ARRAY_TASK_ID SLURM_ARRAY_TASK_COUNT NGC_ARRAY_INDEX NGC_ARRAY_SIZE RANK WORLD_SIZE SLURM_PROCID SLURM_NTASKS LOCAL_RANK
export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120
cd /results/gpt3_tiny/rlhf_ppo

# The job's companions, each with its own log; the main program after them.
companion_logs=/results/gpt3_tiny/rlhf_ppo/companions
mkdir -p "$companion_logs"
declare -A companion=()

python3 -u -m launcher_scripts.jobs.fine_tuning.ppo_server \
    --config /results/gpt3_tiny/rlhf_ppo/rlhf_ppo_gpt3_tiny_hydra.yaml \
    --stage rlhf_ppo \
    --role reward_model \
    >"$companion_logs"/reward_model.log 2>&1 &
companion[$!]=reward_model

python3 -u -m launcher_scripts.jobs.fine_tuning.ppo_server \
    --config /results/gpt3_tiny/rlhf_ppo/rlhf_ppo_gpt3_tiny_hydra.yaml \
    --stage rlhf_ppo \
    --role initial_policy \
    >"$companion_logs"/initial_policy.log 2>&1 &
companion[$!]=initial_policy

python3 -u -m launcher_scripts.jobs.fine_tuning.ppo_server \
    --config /results/gpt3_tiny/rlhf_ppo/rlhf_ppo_gpt3_tiny_hydra.yaml \
    --stage rlhf_ppo \
    --role critic \
    >"$companion_logs"/critic.log 2>&1 &
companion[$!]=critic

python3 -u -m launcher_scripts.jobs.fine_tuning.finetune \
    --config /results/gpt3_tiny/rlhf_ppo/rlhf_ppo_gpt3_tiny_hydra.yaml \
    --stage rlhf_ppo &
main=$!
trap 'kill -s TERM "$main" 2>/dev/null || true' TERM
trap 'kill -s INT "$main" 2>/dev/null || true' INT
end_companions() {
    local pid
    for pid in "${!companion[@]}"; do kill -s TERM "$pid" 2>/dev/null || true; done
    wait || true
}
while kill -0 "$main" 2>/dev/null; do
    for pid in "${!companion[@]}"; do
        kill -0 "$pid" 2>/dev/null && continue
        code=0
        wait "$pid" || code=$?
        name=${companion[$pid]}
        unset "companion[$pid]"
        ((code == 0)) && continue
        echo "error: the job's $name ended with exit code $code while the main program ran: the run stops (its log: $companion_logs/$name.log)" >&2
        kill -s TERM "$main" 2>/dev/null || true
        end_companions
        exit 1
    done
    sleep 1
done
code=0
wait "$main" || code=$?
end_companions
exit "$code"
