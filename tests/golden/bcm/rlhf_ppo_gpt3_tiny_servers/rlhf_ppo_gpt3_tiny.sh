#!/usr/bin/env bash
# Stage rlhf_ppo, job rlhf_ppo_gpt3_tiny: rendered by launcher_scripts (Slurm backend).
# A heterogeneous job: the main program, and reward_model, initial_policy, critic beside it.
#SBATCH --job-name=launcher:rlhf_ppo_gpt3_tiny
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=1:00:00
#SBATCH --output=/results/gpt3_tiny/rlhf_ppo/slurm-rlhf_ppo_gpt3_tiny_%j.out
#SBATCH --signal=B:USR1@120
#SBATCH hetjob
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=1:00:00
#SBATCH hetjob
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=1:00:00
#SBATCH hetjob
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=1:00:00
set -euo pipefail
exec >>/results/gpt3_tiny/rlhf_ppo/log-rlhf_ppo_gpt3_tiny_"${SLURM_JOB_ID}"_attempt"${SLURM_RESTART_COUNT:-0}".out 2>&1

export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
port=$((20000 + SLURM_JOB_ID % 20000))
LAUNCHER_MAIN_HOST="$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0" | head -n 1)"
export LAUNCHER_MAIN_HOST
cd /results/gpt3_tiny/rlhf_ppo

# The job's companions, each with its own log; the main program after them.
companion_logs=/results/gpt3_tiny/rlhf_ppo/companions
mkdir -p "$companion_logs"
declare -A companion=()

MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_1" | head -n 1)" MASTER_PORT=$((port + 1)) \
    srun \
    --het-group=1 \
    --ntasks-per-node=1 \
    --kill-on-bad-exit=1 python3 -u -m launcher_scripts.jobs.fine_tuning.ppo_server \
    --config /results/gpt3_tiny/rlhf_ppo/rlhf_ppo_gpt3_tiny_hydra.yaml \
    --stage rlhf_ppo \
    --role reward_model \
    >"$companion_logs"/reward_model.log 2>&1 &
companion[$!]=reward_model

MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_2" | head -n 1)" MASTER_PORT=$((port + 2)) \
    srun \
    --het-group=2 \
    --ntasks-per-node=1 \
    --kill-on-bad-exit=1 python3 -u -m launcher_scripts.jobs.fine_tuning.ppo_server \
    --config /results/gpt3_tiny/rlhf_ppo/rlhf_ppo_gpt3_tiny_hydra.yaml \
    --stage rlhf_ppo \
    --role initial_policy \
    >"$companion_logs"/initial_policy.log 2>&1 &
companion[$!]=initial_policy

MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_3" | head -n 1)" MASTER_PORT=$((port + 3)) \
    srun \
    --het-group=3 \
    --ntasks-per-node=1 \
    --kill-on-bad-exit=1 python3 -u -m launcher_scripts.jobs.fine_tuning.ppo_server \
    --config /results/gpt3_tiny/rlhf_ppo/rlhf_ppo_gpt3_tiny_hydra.yaml \
    --stage rlhf_ppo \
    --role critic \
    >"$companion_logs"/critic.log 2>&1 &
companion[$!]=critic

MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0" | head -n 1)" MASTER_PORT=$((port + 0)) \
    srun \
    --het-group=0 \
    --ntasks-per-node=1 \
    --kill-on-bad-exit=1 python3 -u -m launcher_scripts.jobs.fine_tuning.finetune \
    --config /results/gpt3_tiny/rlhf_ppo/rlhf_ppo_gpt3_tiny_hydra.yaml \
    --stage rlhf_ppo &
main=$!
trap 'kill -s USR1 "$main" 2>/dev/null || true' USR1
trap 'kill -s USR1 "$main" 2>/dev/null || true' USR2
trap 'kill -s TERM "$main" 2>/dev/null || true' TERM
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
