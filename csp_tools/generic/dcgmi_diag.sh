#!/usr/bin/env bash
# GPU diagnostics on every node of the job, by hand (cluster_validation.sh runs the same probe):
#   sbatch -p <partition> -w <node list> -o <job log file> csp_tools/<csp>/dcgmi_diag.sh
# One JSON report per node in the log; the job fails when a node fails. GPUS_PER_NODE (8) and
# DCGM_LEVEL (the provider's validation.yaml) may be set in the environment of sbatch.
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --time=30
#SBATCH --job-name=dcgmi_diag
set -euo pipefail
command="$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=//p' | head -n 1)"
# shellcheck source=csp_tools/generic/job_root.sh
source "$(dirname "$command")/../generic/job_root.sh"
level="${DCGM_LEVEL:-$(python3 -m csp_tools.validation.settings --csp="$csp" --get=node.dcgm_level)}"
srun --ntasks-per-node=1 python3 -m csp_tools.validation.node_probe \
    --expect-gpus="${GPUS_PER_NODE:-8}" --dcgm-level="$level"
