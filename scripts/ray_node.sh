# Shared by scripts/ray_head.sh and scripts/ray_env_node.sh (sourced, not run): one Ray node of
# the environments' cluster started in the background from the workbench's .venv, and stopped again.
# `ray start --block` runs in a process group of its own (setsid); its pid goes to
# $ARPO_RAY_STATE_DIR/<host>/<name>.pid (default ~/.cache/arpo-workbench/ray/<host>: one directory per
# host, so that nodes sharing a home directory keep their own) and its output to <name>.log. --stop
# ends exactly that node (SIGTERM: `ray start --block` stops the raylet and everything it started),
# never another Ray on the machine, which `ray stop` would. --block runs the node in the foreground
# instead, until it is signalled (what a SLURM step wants: the step ends, the node stops).
# ARPO_RAY_START_ARGS: more arguments for every `ray start` (e.g. "--node-ip-address 10.0.0.5").
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RAY="$ROOT/.venv/bin/ray"
STATE="${ARPO_RAY_STATE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/arpo-workbench/ray}/$(hostname -s)"
read -r -a START_ARGS <<<"${ARPO_RAY_START_ARGS:-}"
# Ray's token authentication: a head started where a token exists (~/.ray/auth_token, which Ray's own
# ray.init() makes, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN) requires it of every node, but a node joining
# looks for none unless told: with a token at hand, head and nodes both use it (the same token must be
# on every node: a shared home has it), unless RAY_AUTH_MODE says otherwise.
token_file="${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}"
if [ -z "${RAY_AUTH_MODE:-}" ] && { [ -n "${RAY_AUTH_TOKEN:-}" ] || [ -s "$token_file" ]; }; then
  export RAY_AUTH_MODE=token
fi
START_TIMEOUT_S="${ARPO_RAY_START_TIMEOUT_S:-120}"
STOP_TIMEOUT_S=30

say() { printf '[%s] %s\n' "$(basename "$0")" "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }
[ -x "$RAY" ] || die "no ray at $RAY: run ./workbench setup in $ROOT first (Ray comes with the .venv)"

# Environment slots a node offers by default: one desktop (VM or sandbox) per 2 cores and per 4 GiB.
default_slots() {
  local cores mem_gib slots
  cores="$(nproc)"
  mem_gib=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 / 1024 ))
  slots=$(( cores / 2 < mem_gib / 4 ? cores / 2 : mem_gib / 4 ))
  echo $(( slots > 0 ? slots : 1 ))
}

node_pid() {  # NAME -> the pid of the node started here under that name, if it still runs
  local pid
  pid="$(cat "$STATE/$1.pid" 2>/dev/null)" || return 1
  kill -0 "$pid" 2>/dev/null && echo "$pid"
}

# Environment slots: a number, or `auto` (default_slots).
slots_of() {
  local slots="$1"
  [ "$slots" = auto ] && slots="$(default_slots)"
  [[ "$slots" =~ ^[0-9]+$ ]] || die "--slots takes a number of environments or auto, not $slots"
  echo "$slots"
}

run_node() {  # NAME RAY_START_ARGS...: the node in the foreground (--block), until it is signalled
  say "starting the $1 in the foreground: it runs until this process is signalled"
  shift
  RAY_USAGE_STATS_ENABLED=0 exec "$RAY" start --block --disable-usage-stats "$@" "${START_ARGS[@]}" </dev/null
}

start_node() {  # NAME RAY_START_ARGS...: returns once Ray says the node runs
  local name="$1" pid log waited
  shift
  if pid="$(node_pid "$name")"; then
    die "the $name started here still runs (pid $pid): stop it first with --stop"
  fi
  mkdir -p "$STATE"
  log="$STATE/$name.log"
  RAY_USAGE_STATS_ENABLED=0 setsid "$RAY" start --block --disable-usage-stats "$@" "${START_ARGS[@]}" \
    >"$log" 2>&1 </dev/null &
  pid=$!
  echo "$pid" >"$STATE/$name.pid"
  for ((waited = 0; waited < START_TIMEOUT_S; waited++)); do
    if grep -qs "Ray runtime started" "$log"; then
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      rm -f "$STATE/$name.pid"
      tail -n 20 "$log" >&2
      die "ray start failed (above; the whole log: $log)"
    fi
    sleep 1
  done
  stop_node "$name"
  die "the $name was not up after $START_TIMEOUT_S s (ARPO_RAY_START_TIMEOUT_S; log: $log)"
}

stop_node() {  # NAME
  local name="$1" pid waited
  if ! pid="$(node_pid "$name")"; then
    rm -f "$STATE/$name.pid"
    say "no $name started here is running"
    return 0
  fi
  kill -TERM "$pid"
  for ((waited = 0; waited < STOP_TIMEOUT_S; waited++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  # what is left of the node's own process group (its pid is the group's id)
  kill -KILL -- "-$pid" 2>/dev/null || true
  rm -f "$STATE/$name.pid"
  say "stopped the $name (pid $pid)"
}

node_ip() {  # LOG -> the node's address as Ray printed it
  sed -n 's/.*Local node IP: \([^ ]*\).*/\1/p' "$1" | head -n 1
}
