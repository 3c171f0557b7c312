#!/usr/bin/env bash
# ARPO's full run under SLURM: one task per GPU node, each starting the config's training processes
# per node (train.nproc_per_node; torchrun via `python -m arpo_lib train`). The VMs run on CPU nodes
# of a Ray cluster started beforehand (scripts/ray_head.sh, scripts/ray_env_node.sh: docs/several-gpus.md);
# runs/ must be on a file system all nodes share.
# Submit from the workbench's directory after `./workbench setup` there: the nodes use its .venv.
#
#   sbatch scripts/slurm_train.sh                                   # configs/osworld_full128.yaml
#   sbatch scripts/slurm_train.sh configs/my.yaml train.steps=60
#
# Before anything starts on the nodes the launch is checked whole (`train --dry-run` with the same
# arguments and the allocation's GPUs per node): a launch the trainer would refuse stops here with every
# problem and its fix. Environment: ARPO_NPROC_PER_NODE overrides the config's processes per node;
# ARPO_MASTER_PORT the rendezvous port (29500); the variable serve.api_key_env names (the servers' key,
# which the other nodes' ranks send to rank 0's gateway) is generated once for all nodes when unset;
# ARPO_ANNOUNCE_HOST=master announces rank 0's servers at MASTER_ADDR instead of each node's own address.
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
# Training processes per node: the config's (train.nproc_per_node, or an override of it), unless
# ARPO_NPROC_PER_NODE says otherwise.
procs=()
[ -n "${ARPO_NPROC_PER_NODE:-}" ] && procs=(--nproc-per-node "$ARPO_NPROC_PER_NODE")
launch=(--config "$config" "${procs[@]}" --nnodes "$SLURM_NNODES" --master-addr "$master" --master-port "$port"
        --rdzv-id "${SLURM_JOB_ID:-arpo}")

# The servers' API key: one value for every node (srun passes the environment on), never printed.
key_env="$("$python" -c 'import sys; from arpo_lib.run.config import load_config
cfg = load_config(sys.argv[1], sys.argv[2:]); print(cfg.rollout.api_key_env or cfg.serve.api_key_env or "")' \
  "$config" "$@")"
if [ -n "$key_env" ] && [ -z "${!key_env:-}" ]; then
  export "$key_env=$("$python" -c 'import secrets; print(secrets.token_hex(16))')"
  echo "slurm_train.sh: generated the servers' API key in $key_env for this job's nodes"
fi

# The whole launch, checked here before anything starts on the nodes.
"$python" -m arpo_lib train "${launch[@]}" --dry-run --gpus-per-node "$gpus" "$@" || {
  echo "slurm_train.sh: the launch check failed (above): nothing was started" >&2
  exit 2
}

# Rank 0's servers are announced at the address of whichever node rank 0 lands on (c10d assigns
# ranks as nodes join): each node passes its own.
announce=""
if [ "$SLURM_NNODES" -gt 1 ] && [ "${ARPO_ANNOUNCE_HOST:-}" != master ]; then
  announce='"serve.announce_host=$(hostname -I | cut -d" " -f1)"'   # expanded on each node
fi
# NCCL: a collective that times out (30 min, training/distributed.py) aborts the process instead of
# hanging it, and --kill-on-bad-exit then ends every node's processes; NCCL_DEBUG=INFO to debug.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME: each node's launch (--nnodes > 1) sets them to the interface
# that reaches $master, unless exported here (gloo on an unreachable address waits 2 h).
# srun starts one copy per node; they meet by c10d rendezvous at the first node (rendezvous id: the
# job id, so a re-queued job, which resumes, meets again). --kill-on-bad-exit: one failed node ends all.
srun --kill-on-bad-exit=1 bash -c "exec '$python' -m arpo_lib train ${launch[*]@Q} --resume ${*@Q} $announce"
