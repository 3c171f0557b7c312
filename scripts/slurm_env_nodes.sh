#!/usr/bin/env bash
# The environment nodes of a run as a SLURM allocation of their own (CPU nodes): the Ray head on the
# allocation's first node, every node (the first too) offering environment slots, until the job ends.
# The head's address (HOST:PORT) is written to $ARPO_RAY_ADDRESS_FILE, by default
# runs/ray-head-<job id>.address (runs/ on a file system the training job sees), for the training job:
#
#   envjob=$(sbatch --parsable scripts/slurm_env_nodes.sh)
#   ARPO_RAY_HEAD=runs/ray-head-$envjob.address sbatch --dependency=after:$envjob \
#       scripts/slurm_train.sh configs/osworld_full128.yaml
#
# Submit from the workbench's directory after `./workbench setup --role env` there (and
# `./workbench setup-osworld`, the task data, for OSWorld tasks): the nodes use its .venv.
# Environment: ARPO_ENV_SLOTS (environments per node; default: one per 2 cores and per 4 GiB of each
# node), ARPO_RAY_PORT (the head's port, 6379), ARPO_RAY_START_ARGS (more `ray start` arguments).
#
#SBATCH --job-name=arpo-envs
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=64
#SBATCH --time=72:00:00
#SBATCH --output=runs/slurm-envs-%j.out
set -euo pipefail
[ -x "$PWD/.venv/bin/ray" ] || { echo "slurm_env_nodes.sh: no Ray at $PWD/.venv/bin/ray: run ./workbench setup --role env" \
                                      "in $PWD first (once), then submit from there" >&2; exit 1; }
scripts="$PWD/scripts"
slots="${ARPO_ENV_SLOTS:-auto}"
address_file="${ARPO_RAY_ADDRESS_FILE:-runs/ray-head-${SLURM_JOB_ID:-local}.address}"
nodes="${SLURM_NNODES:-1}"

# The head on this node (the batch script runs on the allocation's first node), which hosts
# environments as well; it lives until this script ends.
address="$(bash "$scripts/ray_head.sh" --port "${ARPO_RAY_PORT:-6379}" --slots "$slots")"
stopping() {
  set +e  # every step, whatever the one before returned
  trap - EXIT INT TERM
  [ -n "${others:-}" ] && kill -TERM "$others" 2>/dev/null && wait "$others" 2>/dev/null
  rm -f "$address_file"
  bash "$scripts/ray_head.sh" --stop
}
trap stopping EXIT
trap 'exit 143' INT TERM
mkdir -p "$(dirname "$address_file")"
echo "$address" >"$address_file.$$"
mv "$address_file.$$" "$address_file"
echo "slurm_env_nodes.sh: the head runs at $address (written to $address_file); $nodes node(s) offer environments"

# The other nodes join in the foreground, one task each, for as long as the job runs.
if [ "$nodes" -gt 1 ]; then
  srun --relative=1 --nodes=$((nodes - 1)) --ntasks-per-node=1 \
    bash "$scripts/ray_env_node.sh" "$address" --slots "$slots" --block &
  others=$!
  wait "$others"
else
  while bash "$scripts/ray_head.sh" --running 2>/dev/null; do sleep 10; done
fi
