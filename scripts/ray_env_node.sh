#!/usr/bin/env bash
# Join the environments' Ray cluster (scripts/ray_head.sh prints ADDRESS) as a node offering N
# environment slots (the `env_slot` resource; each environment actor takes one: env.ray_resource=env_slot).
#
#   scripts/ray_env_node.sh ADDRESS [--slots N|auto] [--num-cpus N] [--temp-dir DIR] [--block] [-- RAY_START_ARGS...]
#   scripts/ray_env_node.sh --stop
#
# --slots: default `auto`, one desktop per 2 cores and per 4 GiB of memory (OSWorld's VMs want 4 GB and a
# few vCPUs each; ARPO ran 16 per CPU node). A training node joins with --slots 0: it hosts no environments,
# but its ranks' Ray drivers attach to a raylet on their own host, so every training node must be a node
# of the cluster. --block: run in the foreground until signalled (under srun: the step's end stops the
# node). Arguments after -- go to `ray start` unchanged.
source "$(dirname "$0")/ray_node.sh"

address=""
slots=auto
block=0
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --stop) stop_node env-node; exit 0 ;;
    --slots) slots="$2"; shift ;;
    --num-cpus) extra+=(--num-cpus "$2"); shift ;;
    --temp-dir) extra+=(--temp-dir "$2"); shift ;;
    --block) block=1 ;;
    --) shift; extra+=("$@"); break ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 0 ;;
    -*) die "unknown argument $1 (see --help)" ;;
    *) [ -z "$address" ] || die "one ADDRESS only (got $address and $1)"; address="$1" ;;
  esac
  shift
done
[ -n "$address" ] || die "give the head's ADDRESS (HOST:PORT, printed by scripts/ray_head.sh)"
slots="$(slots_of "$slots")"

args=(--address "$address" --resources "{\"env_slot\": $slots}" "${extra[@]}")
[ "$block" = 1 ] && run_node env-node "${args[@]}"
start_node env-node "${args[@]}"
say "joined $address as $(node_ip "$STATE/env-node.log") with $slots env_slot(s) (pid $(node_pid env-node);" \
    "log $STATE/env-node.log); stop with scripts/ray_env_node.sh --stop"
