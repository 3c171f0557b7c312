#!/usr/bin/env bash
# ARPO's full run under SLURM: one task per GPU node, each starting 8 training processes (torchrun
# via ./workbench train --nproc-per-node). The VMs run on CPU nodes of a Ray cluster started
# beforehand (see configs/osworld_full128.yaml); runs/ must be on a file system all nodes share.
#
#   sbatch scripts/slurm_train.sh                          # configs/osworld_full128.yaml
#   sbatch scripts/slurm_train.sh configs/my.yaml train.steps=60
#
#SBATCH --job-name=arpo-full128
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=72:00:00
#SBATCH --output=runs/slurm-%j.out
set -euo pipefail
config="${1:-configs/osworld_full128.yaml}"
[ $# -gt 0 ] && shift
master="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
port="${ARPO_MASTER_PORT:-29500}"
gpus="${SLURM_GPUS_PER_NODE:-8}"
gpus="${gpus##*:}"   # "h100:8" -> 8
# NCCL: a collective that times out (30 min, training/distributed.py) aborts the process instead of
# hanging it, and --kill-on-bad-exit then ends every node's processes; NCCL_DEBUG=INFO to debug.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# srun starts one copy per node; they meet by c10d rendezvous at the first node (rendezvous id: the
# job id, so a re-queued job, which resumes, meets again). --kill-on-bad-exit: one failed node ends all.
srun --kill-on-bad-exit=1 bash -c "./workbench train --config '$config' --resume \
  --nproc-per-node $gpus --nnodes $SLURM_NNODES \
  --master-addr $master --master-port $port --rdzv-id ${SLURM_JOB_ID:-arpo} $*"
