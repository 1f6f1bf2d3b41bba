#!/usr/bin/env bash
# An all-reduce across the job's nodes, by hand (cluster_validation.sh sweeps pairs of nodes):
#   sbatch -w <node 1>,<node 2> -o <job log file> csp_tools/<csp>/nccl.sh
# nccl-tests' all_reduce_perf where build-nccl-tests.sh built it (or it is on PATH), else the
# built-in sweep (torch.distributed; NCCL on GPUs, gloo on CPUs), both printing busbw per size.
# Add --ntasks-per-node=1 to sbatch's own arguments for nodes without GPUs.
#SBATCH --ntasks-per-node=8
#SBATCH --exclusive
#SBATCH --time=30
#SBATCH --job-name=nccl
set -euo pipefail
command="$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=//p' | head -n 1)"
# shellcheck source=csp_tools/generic/job_root.sh
source "$(dirname "$command")/../generic/job_root.sh"
ranks="${SLURM_NTASKS:-$SLURM_JOB_NUM_NODES}"
if ((ranks < 2)); then
    # One rank all-reduces with nothing: its busbw would read 0 whatever the link.
    echo "nccl.sh: $ranks rank: an all-reduce measures links between 2 ranks or more; submit" \
        "it on 2 nodes or more (sbatch -w NODE1,NODE2 ...), or with a task per GPU" >&2
    exit 2
fi
min_bytes="${MIN_BYTES:-$(python3 -m csp_tools.validation.settings --csp="$csp" --get=interconnect.min_bytes)}"
max_bytes="${MAX_BYTES:-$(python3 -m csp_tools.validation.settings --csp="$csp" --get=interconnect.max_bytes)}"
built="$root/csp_tools/nccl-tests/build/all_reduce_perf"
perf="$(command -v all_reduce_perf || { [[ -x $built ]] && echo "$built"; } || true)"
if [[ -n $perf ]]; then
    srun --mpi=pmix "$perf" -b "$min_bytes" -e "$max_bytes" -f 4 -g 1
else
    srun python3 -m csp_tools.validation.allreduce_sweep \
        --min-bytes="$min_bytes" --max-bytes="$max_bytes"
fi
