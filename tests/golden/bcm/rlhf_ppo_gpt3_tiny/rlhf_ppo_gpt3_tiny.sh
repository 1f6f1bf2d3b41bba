#!/usr/bin/env bash
# Stage rlhf_ppo, job rlhf_ppo_gpt3_tiny: rendered by launcher_scripts (Slurm backend).
#SBATCH --job-name=launcher:rlhf_ppo_gpt3_tiny
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=1:00:00
#SBATCH --output=/results/gpt3_tiny/rlhf_ppo/slurm-rlhf_ppo_gpt3_tiny_%j.out
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail
exec >>/results/gpt3_tiny/rlhf_ppo/log-rlhf_ppo_gpt3_tiny_"${SLURM_JOB_ID}"_attempt"${SLURM_RESTART_COUNT:-0}".out 2>&1

export PYTHONPATH=/opt/launcher${PYTHONPATH:+:${PYTHONPATH}}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export TRANSFORMERS_OFFLINE=1
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export MASTER_ADDR MASTER_PORT
cd /results/gpt3_tiny/rlhf_ppo

step_pid=
cancelled=0
stop_asked=0
trap 'stop_asked=1; echo "launcher: USR1 received, asking the job step to checkpoint"; if [ -n "$step_pid" ]; then kill -USR1 "$step_pid" 2>/dev/null || true; fi' USR1
trap 'cancelled=1; echo "launcher: cancel requested, asking the job step to checkpoint and stop"; if [ -n "$step_pid" ]; then kill -USR1 "$step_pid" 2>/dev/null || true; fi' USR2
step_before=$(python3 -m launcher_scripts.formats.progress /results/gpt3_tiny/rlhf_ppo/results/checkpoints)
if [ "$cancelled" -eq 1 ]; then
    echo "launcher: cancelled before the job step started"
    scancel "$SLURM_JOB_ID"
    exit 0
fi
srun \
    --ntasks-per-node=1 \
    --kill-on-bad-exit=1 python3 -u -m launcher_scripts.jobs.fine_tuning.finetune \
    --config /results/gpt3_tiny/rlhf_ppo/rlhf_ppo_gpt3_tiny_hydra.yaml \
    --stage rlhf_ppo &
step_pid=$!
set +e
while :; do
    wait "$step_pid"; code=$?
    kill -0 "$step_pid" 2>/dev/null || break  # wait was interrupted by the trap
done
set -e
step_after=$(python3 -m launcher_scripts.formats.progress /results/gpt3_tiny/rlhf_ppo/results/checkpoints)
if [ "$cancelled" -eq 1 ] && [ "$code" -ne 0 ]; then
    echo "launcher: cancelled (exit code $code); newest checkpoint at step $step_after; not requeued"
    scancel "$SLURM_JOB_ID"
    exit "$code"
fi
on_signal=0
if [ "$code" -eq 75 ] || { [ "$stop_asked" -eq 1 ] && [ "$code" -ne 0 ]; }; then
    on_signal=1
fi
if [ "$on_signal" -eq 1 ]; then
    if [ "${SLURM_RESTART_COUNT:-0}" -ge 3 ]; then
        echo "launcher: not requeued: max_restarts (3) reached"
    elif [ "$step_after" -le "$step_before" ]; then
        echo "launcher: not requeued: no new checkpoint since the last attempt"
    else
        echo "launcher: checkpoint at step $step_after; requeueing"
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    fi
fi
exit "$code"
