#!/usr/bin/env bash
# ARPO's full run under SLURM: one task per GPU node, each starting the config's training processes
# per node (train.nproc_per_node; torchrun via `python -m arpo_lib train`). The VMs run on CPU nodes
# of a Ray cluster (docs/cluster.md); runs/ must be on a file system all nodes share.
# Submit from the workbench's directory after `./workbench setup` there: the nodes use its .venv.
#
#   sbatch scripts/slurm_train.sh                                   # configs/osworld_full128.yaml
#   sbatch scripts/slurm_train.sh configs/my.yaml train.steps=60
#
# The environments' Ray cluster, when ARPO_RAY_HEAD says where its head is (env.backend=ray configs):
#   ARPO_RAY_HEAD=here        the head starts on this job's first node, beside rank 0's rendezvous, and the
#                             run waits (ARPO_RAY_WAIT_S, 600 s) until the cluster offers env.workers slots;
#   ARPO_RAY_HEAD=HOST:PORT   a head running elsewhere (a standing cluster);
#   ARPO_RAY_HEAD=FILE        the file scripts/slurm_env_nodes.sh writes its head's address to (a second
#                             allocation), waited for up to ARPO_RAY_WAIT_S seconds.
# In a heterogeneous job the second component's nodes join as the environment nodes (ARPO_ENV_SLOTS
# environments each; default one per 2 cores and 4 GiB):
#   ARPO_RAY_HEAD=here sbatch --nodes=2 --ntasks-per-node=1 --gpus-per-node=8 --cpus-per-task=32 \
#       : --nodes=8 --ntasks-per-node=1 --cpus-per-task=64 scripts/slurm_train.sh configs/osworld_full128.yaml
# Every training node then joins the cluster with no environment slots before it trains (a rank's Ray
# driver attaches to a raylet on its own host) and the trainer gets env.ray_address=HOST:PORT. Unset:
# the nodes are already part of a cluster (env.ray_address as the config says). ARPO_RAY_PORT: the
# port of a head started here (6379). docs/cluster.md has the recipe.
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
het=()
if [ -n "${SLURM_HET_SIZE:-}" ]; then  # a heterogeneous job: component 0 trains, component 1 hosts environments
  SLURM_JOB_NODELIST="${SLURM_JOB_NODELIST_HET_GROUP_0:-$SLURM_JOB_NODELIST}"
  SLURM_NNODES="${SLURM_NNODES_HET_GROUP_0:-$SLURM_NNODES}"
  SLURM_GPUS_PER_NODE="${SLURM_GPUS_PER_NODE_HET_GROUP_0:-${SLURM_GPUS_PER_NODE:-}}"
  het=(--het-group=0)
fi
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

# Where the environments' Ray head is (ARPO_RAY_HEAD, above): its address, once known.
ray_head="${ARPO_RAY_HEAD:-}"
ray=()
if [ -n "$ray_head" ] && [ "$ray_head" != here ] && ! [[ "$ray_head" =~ ^[^/]+:[0-9]+$ ]]; then
  file="$ray_head"
  for ((waited = 0; waited < ${ARPO_RAY_WAIT_S:-600}; waited += 5)); do
    [ -s "$file" ] && break
    sleep 5
  done
  [ -s "$file" ] || { echo "slurm_train.sh: no Ray head address in $file after ${ARPO_RAY_WAIT_S:-600} s (is the" \
                           "environment job, scripts/slurm_env_nodes.sh, running?): nothing was started" >&2; exit 3; }
  ray_head="$(cat "$file")"
fi
if [ -n "$ray_head" ]; then
  export ARPO_RAY_STATE_DIR="${ARPO_RAY_STATE_DIR:-${TMPDIR:-/tmp}/arpo-ray-${SLURM_JOB_ID:-$$}}"
  # the check below tries a head that runs; one this job starts is not up yet
  ray=("env.ray_address=$([ "$ray_head" = here ] && echo auto || echo "$ray_head")")
fi

# The whole launch, checked here before anything starts on the nodes.
"$python" -m arpo_lib train "${launch[@]}" --dry-run --gpus-per-node "$gpus" "$@" "${ray[@]}" || {
  echo "slurm_train.sh: the launch check failed (above): nothing was started" >&2
  exit 2
}

# The head beside rank 0, the environment nodes of a heterogeneous job, and the wait for their slots.
join=""
if [ -n "$ray_head" ]; then
  envs=""
  if [ "$ray_head" = here ]; then
    ray_head="$(bash scripts/ray_head.sh --port "${ARPO_RAY_PORT:-6379}")"
    head_host="$(hostname -s)"
  fi
  trap 'set +e; [ -n "$envs" ] && kill -TERM "$envs" 2>/dev/null && wait "$envs"; [ -z "${head_host:-}" ] ||
        bash scripts/ray_head.sh --stop' EXIT
  if [ ${#het[@]} -gt 0 ]; then
    srun --het-group=1 --ntasks-per-node=1 \
      bash scripts/ray_env_node.sh "$ray_head" --slots "${ARPO_ENV_SLOTS:-auto}" --block &
    envs=$!
  fi
  if [ -n "${head_host:-}" ]; then  # a driver here attaches to the head's raylet
    "$python" - "$ray_head" "${ARPO_RAY_WAIT_S:-600}" "$config" "$@" <<'PY' || exit 3
import logging, sys, time
import ray
from arpo_lib.envs.workers.ray_pool import use_token_when_there_is_one
from arpo_lib.run.config import load_config
address, wait_s, config, overrides = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4:]
cfg = load_config(config, overrides)
resource, wanted = cfg.env.ray_resource or "CPU", cfg.env.workers
use_token_when_there_is_one()
ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
deadline, offered = time.monotonic() + wait_s, 0
while time.monotonic() < deadline and (offered := ray.cluster_resources().get(resource, 0)) < wanted:
    time.sleep(5)
print(f"slurm_train.sh: the Ray cluster at {address} offers {offered:g} {resource} (the run needs {wanted})",
      file=sys.stderr if offered < wanted else sys.stdout)
sys.exit(0 if offered >= wanted else 1)
PY
  fi
  # each training node joins (but the head's), then trains on the cluster at the head
  if [ -n "${head_host:-}" ]; then
    join="$(printf '[ "$(hostname -s)" = %q ] || ' "$head_host")"
  fi
  join+="bash $(printf %q "$PWD/scripts/ray_env_node.sh") $(printf %q "$ray_head") --slots 0 && "
  ray=("env.ray_address=$ray_head")
fi

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
srun "${het[@]}" --kill-on-bad-exit=1 bash -c "${join}exec '$python' -m arpo_lib train ${launch[*]@Q} --resume ${*@Q} \
${ray[*]@Q} $announce"
