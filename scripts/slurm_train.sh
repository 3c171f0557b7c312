#!/usr/bin/env bash
# ARPO's full run under SLURM: one task per GPU node, each starting 8 training processes (torchrun
# via `python -m arpo_lib train --nproc-per-node`). The VMs run on CPU nodes of a Ray cluster started
# beforehand (see configs/osworld_full128.yaml); runs/ must be on a file system all nodes share.
# Submit from the workbench's directory after `./workbench setup` there: the nodes use its .venv.
#
#   ARPO_NPROC_PER_NODE=6 sbatch scripts/slurm_train.sh    # configs/osworld_full128.yaml (2 GPUs serve)
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
# The venv's python, not ./workbench: that runs the set-up first (apt with sudo, pip into .venv),
# which on every node at once is concurrent pip installs into the one shared .venv.
python="$PWD/.venv/bin/python"
if [ ! -x "$python" ]; then
  echo "slurm_train.sh: no Python environment at $python: run ./workbench setup in $PWD first (once, on a" \
       "login node), then submit from there" >&2
  exit 1
fi
export VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH"   # as `source .venv/bin/activate` (srun passes it on)
config="${1:-configs/osworld_full128.yaml}"
[ $# -gt 0 ] && shift
master="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
port="${ARPO_MASTER_PORT:-29500}"
gpus="${SLURM_GPUS_PER_NODE:-8}"
gpus="${gpus##*:}"   # "h100:8" -> 8
# Training processes per node: every GPU, unless the config's own vLLM servers take some of them
# (configs/osworld_full128.yaml: ARPO_NPROC_PER_NODE=6 beside two servers on GPUs 6 and 7; the
# trainer refuses an overlap at start, arpo_lib/build.py check_server_gpus_are_free).
procs="${ARPO_NPROC_PER_NODE:-$gpus}"
# NCCL: a collective that times out (30 min, training/distributed.py) aborts the process instead of
# hanging it, and --kill-on-bad-exit then ends every node's processes; NCCL_DEBUG=INFO to debug.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME: each node's launch (--nnodes > 1) sets them to the interface
# that reaches $master, unless exported here (gloo on an unreachable address waits 2 h).
# srun starts one copy per node; they meet by c10d rendezvous at the first node (rendezvous id: the
# job id, so a re-queued job, which resumes, meets again). --kill-on-bad-exit: one failed node ends all.
srun --kill-on-bad-exit=1 bash -c "exec '$python' -m arpo_lib train --config '$config' --resume \
  --nproc-per-node $procs --nnodes $SLURM_NNODES \
  --master-addr $master --master-port $port --rdzv-id ${SLURM_JOB_ID:-arpo} $*"
