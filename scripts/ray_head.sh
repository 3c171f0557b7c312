#!/usr/bin/env bash
# The head of a Ray cluster for the environments (env.backend=ray): beside rank 0 or on a node of its
# own. Prints the address to give the trainer (env.ray_address=HOST:PORT) and the environment nodes.
#
#   scripts/ray_head.sh [--port 6379] [--slots 0|N|auto] [--num-cpus N] [--temp-dir DIR] [--block] [-- RAY_START_ARGS...]
#   scripts/ray_head.sh --stop              # --running: exit 0 while the head started here runs
#
# --slots N: environments this node hosts itself (the `env_slot` resource, one per environment actor:
# env.ray_resource=env_slot); 0 by default, so that the VMs land on the environment nodes only (`auto`:
# one per 2 cores and 4 GiB, as an environment node). --block: run in the foreground until signalled
# (under srun). Arguments after -- go to `ray start` unchanged (e.g. --include-dashboard=false).
source "$(dirname "$0")/ray_node.sh"

port=6379
slots=0
block=0
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --stop) stop_node head; exit 0 ;;
    --running) node_pid head >/dev/null; exit ;;
    --port) port="$2"; shift ;;
    --slots) slots="$2"; shift ;;
    --num-cpus) extra+=(--num-cpus "$2"); shift ;;
    --temp-dir) extra+=(--temp-dir "$2"); shift ;;
    --block) block=1 ;;
    --) shift; extra+=("$@"); break ;;
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
  shift
done
slots="$(slots_of "$slots")"

args=(--head --port "$port" --resources "{\"env_slot\": $slots}" "${extra[@]}")
[ "$block" = 1 ] && run_node head "${args[@]}"
start_node head "${args[@]}"
address="$(node_ip "$STATE/head.log"):$port"
say "Ray head running at $address (pid $(node_pid head); log $STATE/head.log), $slots env_slot(s) here"
say "environment nodes: scripts/ray_env_node.sh $address [--slots N]; training nodes: scripts/ray_env_node.sh $address --slots 0"
say "the trainer: env.backend=ray env.ray_address=$address env.ray_resource=env_slot"
echo "$address"
