# shellcheck shell=bash
# Sourced by the manual Slurm job scripts of csp_tools/<csp>/ (dcgmi_diag.sh, nccl.sh,
# build-nccl-tests.sh). sbatch runs a copy of the script from its spool folder, so the script's
# own path is Slurm's record of the submitted command ($command, set by the script), not
# BASH_SOURCE.
# shellcheck disable=SC2154
csp_dir="$(cd "$(dirname "$command")" && pwd)"
root="$(cd "$csp_dir/../.." && pwd)"
csp="$(basename "$csp_dir")"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# The provider's environment (validation.yaml's env: NCCL and EFA/UCX settings), as the
# cluster validation command exports it in its own steps.
eval "$(python3 -m csp_tools.validation.settings --csp="$csp" --exports)"
