#!/usr/bin/env bash
# Builds nccl-tests (all_reduce_perf, with MPI) into csp_tools/nccl-tests/build, where nccl.sh
# and cluster_validation.sh find it:
#   sbatch -N 1 -o <job log file> csp_tools/<csp>/build-nccl-tests.sh
# CUDA_HOME (/usr/local/cuda), NCCL_HOME and MPI_HOME (found from the compilers on PATH when
# unset) and NCCL_TESTS_REF (a tag or branch, master by default) may be set for sbatch.
#SBATCH --nodes=1
#SBATCH --exclusive
#SBATCH --time=30
#SBATCH --job-name=build-nccl-tests
set -euo pipefail
command="$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=//p' | head -n 1)"
# shellcheck source=csp_tools/generic/job_root.sh
source "$(dirname "$command")/../generic/job_root.sh"
source_dir="$root/csp_tools/nccl-tests"
if [[ ! -d $source_dir/.git ]]; then
    git clone --depth 1 --branch "${NCCL_TESTS_REF:-master}" \
        https://github.com/NVIDIA/nccl-tests.git "$source_dir"
fi
mpi_home="${MPI_HOME:-$(dirname "$(dirname "$(command -v mpicc)")")}"
make -C "$source_dir" -j "$(nproc)" MPI=1 MPI_HOME="$mpi_home" \
    CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" ${NCCL_HOME:+NCCL_HOME="$NCCL_HOME"}
echo "built: $source_dir/build/all_reduce_perf"
