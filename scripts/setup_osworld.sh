#!/usr/bin/env bash
# Idempotent set-up of a SEPARATE virtual environment for OSWorld's desktop_env, in which the OSWorld
# environment workers run (arpo_lib is put on their PYTHONPATH; arpo_lib.envs.osworld imports no torch).
#   bash scripts/setup_osworld.sh         -> builds the venv; prints its python on stdout
#   bash scripts/setup_osworld.sh --vm    -> also pulls the Docker image and downloads the Ubuntu VM disk
#   --desktop-env=fork (default) -> the ARPO authors' fork of OSWorld at ARPO's submodule commit
#       (FanbinLu/OSWorld@7a6409d, from GitHub; its checkers and pause()/unpause(): what ARPO's
#       numbers were scored with); ARPO_DESKTOP_ENV_SOURCE=<a directory or archive of that tree>
#       installs it from a local copy instead (machines without GitHub)
#   --desktop-env=pypi -> PyPI's desktop-env 1.0.2 (OSWorld-Verified era checkers, no pause())
#   What was installed is written to <venv>/arpo-desktop-env.json; every evaluation records it.
#   bash scripts/setup_osworld.sh --light -> desktop-env without its pinned dependencies: only what
#       DesktopEnv, its set-up, getters and metrics import (scripts/osworld_evaluator_requirements.txt)
#       plus the workbench's torch pair (~1.5 GB without torch). With ARPO_OSWORLD_TORCH_FROM=<a
#       site-packages directory that has torch and torchvision> those are borrowed from there instead
#       (appended to sys.path; the tests borrow the training environment's).
# Where: $ARPO_OSWORLD_VENV, default ~/.cache/arpo-workbench/venv-osworld (what
# arpo_lib.envs.osworld.find_osworld_python() looks for); the VM disk goes to $ARPO_OSWORLD_VM, default
# ~/.cache/arpo-workbench/osworld-vm/Ubuntu.qcow2 (what OSWorldEnv uses when path_to_vm is not given).
# Why its own venv: desktop-env 1.0.2 pins torch 2.5.1, transformers 4.35.2, gymnasium 0.28.1 and
# numpy 1.26.4 (259 packages, ~7 GB); none of that may enter the training environment's resolver.
# Base interpreter: $ARPO_OSWORLD_BASE_PYTHON, else python3.11, python3.12 or python3.10.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '[setup-osworld] %s\n' "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }

DESKTOP_ENV_VERSION="1.0.2"
DOCKER_IMAGE="happysixd/osworld-docker"
VM_URL="https://huggingface.co/datasets/xlangai/ubuntu_osworld/resolve/main/Ubuntu.qcow2.zip"

FORK_REPO="FanbinLu/OSWorld"   # = arpo_lib/envs/osworld/build_info.py FORK_REPO / FORK_COMMIT
FORK_COMMIT="7a6409d7f54e335181398b10038ddf3beda9ab33"

WITH_VM=0
LIGHT=0
OFFLINE_HINT=""
CHOICE=fork
for arg in "$@"; do
  case "$arg" in
    --vm) WITH_VM=1 ;;
    --light) LIGHT=1 ;;
    --desktop-env=fork|--desktop-env=pypi) CHOICE="${arg#--desktop-env=}" ;;
    --desktop-env=*) die "--desktop-env must be fork (ARPO's, the default) or pypi (desktop-env $DESKTOP_ENV_VERSION)" ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 0 ;;
    *) die "unknown argument $arg (see --help)" ;;
  esac
done
if [ "$CHOICE" = fork ]; then
  if [ -n "${ARPO_DESKTOP_ENV_SOURCE:-}" ]; then
    [ -e "$ARPO_DESKTOP_ENV_SOURCE" ] || die "ARPO_DESKTOP_ENV_SOURCE=$ARPO_DESKTOP_ENV_SOURCE does not exist"
    if [ -d "$ARPO_DESKTOP_ENV_SOURCE" ]; then
      [ -f "$ARPO_DESKTOP_ENV_SOURCE/setup.py" ] && [ -d "$ARPO_DESKTOP_ENV_SOURCE/desktop_env" ] \
        || die "ARPO_DESKTOP_ENV_SOURCE=$ARPO_DESKTOP_ENV_SOURCE is not an OSWorld tree (setup.py and desktop_env/)"
    fi
    DESKTOP_ENV_REQ="$(cd "$(dirname "$ARPO_DESKTOP_ENV_SOURCE")" && pwd)/$(basename "$ARPO_DESKTOP_ENV_SOURCE")"
    MARKER_JSON="{\"source\": \"fork\", \"repository\": \"$FORK_REPO\", \"commit\": \"$FORK_COMMIT\", \"from\": \"$DESKTOP_ENV_REQ\"}"
  else
    DESKTOP_ENV_REQ="desktop_env @ https://github.com/$FORK_REPO/archive/$FORK_COMMIT.tar.gz"
    # What to do where GitHub cannot be reached (said when pip fails, under its own error).
    OFFLINE_HINT=". The ARPO fork comes from GitHub; if this machine cannot reach it:
  - --desktop-env=pypi installs PyPI's desktop-env $DESKTOP_ENV_VERSION instead (OSWorld-Verified era checkers, no pause()), or
  - ARPO_DESKTOP_ENV_SOURCE=<a directory or archive of the fork's tree at $FORK_COMMIT> installs it from a local copy
    (e.g. the OSWorld/ folder genalyu/3SPO_GUI vendors); see --help"
    MARKER_JSON="{\"source\": \"fork\", \"repository\": \"$FORK_REPO\", \"commit\": \"$FORK_COMMIT\"}"
  fi
else
  DESKTOP_ENV_REQ="desktop-env==$DESKTOP_ENV_VERSION"
  MARKER_JSON="{\"source\": \"pypi\", \"requirement\": \"$DESKTOP_ENV_REQ\"}"
fi

CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/arpo-workbench"
VENV="${ARPO_OSWORLD_VENV:-$CACHE/venv-osworld}"
VM="${ARPO_OSWORLD_VM:-$CACHE/osworld-vm/Ubuntu.qcow2}"
mkdir -p "$(dirname "$VENV")"
PY="${ARPO_OSWORLD_BASE_PYTHON:-$(command -v python3.11 || command -v python3.12 || command -v python3.10 || true)}"
[ -n "$PY" ] && command -v "$PY" >/dev/null || die "no python3.10-3.12 found (set ARPO_OSWORLD_BASE_PYTHON)"
VP="$VENV/bin/python"

# 0. What the Docker provider needs on the host (warnings only: provider "sandbox" needs neither, and
#    the venv is useful without them, e.g. for other providers or for reading the evaluators).
if ! command -v docker >/dev/null; then
  say "WARNING: no docker CLI: OSWorld's Docker provider needs a Docker engine (https://docs.docker.com/engine/install/)"
elif ! docker info >/dev/null 2>&1; then
  say "WARNING: the Docker engine is not reachable (is the daemon running, is this user in group docker?)"
fi
if [ ! -e /dev/kvm ]; then
  say "WARNING: /dev/kvm does not exist: OSWorld VMs would run without hardware virtualisation (far too slow)"
elif [ ! -r /dev/kvm ] || [ ! -w /dev/kvm ]; then
  say "WARNING: /dev/kvm is not accessible to $(id -un): fine with a root Docker daemon, not with rootless Docker"
fi

# 1. The venv itself.
. scripts/venv.sh
ensure_venv "$VENV" "$PY" "assert (3, 10) <= sys.version_info[:2] <= (3, 12)" ARPO_OSWORLD_VENV

# The borrowed torch is a path into another environment, which can move or vanish (a CI checkout
# in a temporary folder): written on every run, not only when the packages are installed.
if [ "$LIGHT" = 1 ] && [ -n "${ARPO_OSWORLD_TORCH_FROM:-}" ]; then
  [ -d "$ARPO_OSWORLD_TORCH_FROM/torch" ] || die "ARPO_OSWORLD_TORCH_FROM=$ARPO_OSWORLD_TORCH_FROM has no torch"
  site="$("$VP" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  if [ "$(cat "$site/zz-arpo-borrowed-torch.pth" 2>/dev/null)" != "$ARPO_OSWORLD_TORCH_FROM" ]; then
    say "borrowing torch and torchvision from $ARPO_OSWORLD_TORCH_FROM (appended to sys.path)"
    printf '%s\n' "$ARPO_OSWORLD_TORCH_FROM" > "$site/zz-arpo-borrowed-torch.pth"
  fi
fi

# 2. The packages (first time: several minutes, ~7 GB). Fast when done: pip runs only when this file changed.
flavour="$CHOICE-full"
[ "$LIGHT" = 1 ] && flavour="$CHOICE-light${ARPO_OSWORLD_TORCH_FROM:+-borrowed}"
stamp="$VENV/.setup-osworld-$flavour-$( (cat scripts/setup_osworld.sh scripts/osworld_evaluator_requirements.txt; \
  printf '%s' "$DESKTOP_ENV_REQ") | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  say "packages up to date ($VENV, $DESKTOP_ENV_REQ, $flavour)"
else
  t0=$SECONDS
  # pip warns once per package about local wheel folders some machines configure: not useful here.
  quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
  quiet "$VP" -m pip install -q --upgrade pip
  if [ "$LIGHT" = 1 ]; then
    say "installing $DESKTOP_ENV_REQ (no pinned dependencies) and what its evaluator imports into $VENV"
    quiet "$VP" -m pip uninstall -q -y desktop-env desktop_env >/dev/null 2>&1 || true
    quiet "$VP" -m pip install -q --no-deps "$DESKTOP_ENV_REQ" easyocr || die "pip install of $DESKTOP_ENV_REQ failed$OFFLINE_HINT"
    quiet "$VP" -m pip install -q -r scripts/osworld_evaluator_requirements.txt || die "pip install failed"
    site="$("$VP" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    if [ -z "${ARPO_OSWORLD_TORCH_FROM:-}" ]; then
      rm -f "$site/zz-arpo-borrowed-torch.pth"
      quiet "$VP" -m pip install -q "torch==2.14.1" "torchvision==0.29.1" || die "pip install failed"
    fi
  else
    say "installing $DESKTOP_ENV_REQ, pillow and pyseccomp into $VENV"
    # pillow: arpo_lib's screenshots (desktop-env pins its own line, which pip keeps);
    # pyseccomp: the desktop sandbox's system-call filter (provider "sandbox").
    quiet "$VP" -m pip uninstall -q -y desktop-env desktop_env >/dev/null 2>&1 || true
    quiet "$VP" -m pip install -q "$DESKTOP_ENV_REQ" pillow pyseccomp || die "pip install of $DESKTOP_ENV_REQ failed$OFFLINE_HINT"
  fi
  printf '%s\n' "$MARKER_JSON" > "$VENV/arpo-desktop-env.json"
  say "checking the imports"
  "$VP" -c 'import desktop_env.desktop_env, docker, PIL, pyseccomp' || die "import check failed"
  rm -f "$VENV"/.setup-osworld-*
  touch "$stamp"
  say "installed in $((SECONDS - t0)) s"
fi
if [ "$LIGHT" = 1 ] && [ -n "${ARPO_OSWORLD_TORCH_FROM:-}" ]; then
  "$VP" -c 'import torch, torchvision' || die "torch borrowed from $ARPO_OSWORLD_TORCH_FROM does not import in $VENV"
fi

# 3. Optional: the VM assets (the Docker image and the Ubuntu disk, ~12 GB zipped), fetched here rather
#    than inside an environment's first reset, where they would exceed every worker timeout.
if [ "$WITH_VM" = 1 ]; then
  command -v docker >/dev/null || die "--vm needs the docker CLI"
  say "pulling $DOCKER_IMAGE"
  docker pull "$DOCKER_IMAGE" >&2 || die "docker pull $DOCKER_IMAGE failed"
  if [ -f "$VM" ]; then
    say "VM disk present: $VM"
  else
    mkdir -p "$(dirname "$VM")"
    zip="$(dirname "$VM")/Ubuntu.qcow2.zip"
    say "downloading $VM_URL (resumable) to $zip"
    curl -fL --retry 5 -C - -o "$zip" "$VM_URL" || die "download failed (run again to resume)"
    say "unzipping"
    "$VP" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$zip" "$(dirname "$VM")" \
      || die "unzip failed"
    [ -f "$(dirname "$VM")/Ubuntu.qcow2" ] || die "the archive had no Ubuntu.qcow2"
    [ "$(dirname "$VM")/Ubuntu.qcow2" = "$VM" ] || mv "$(dirname "$VM")/Ubuntu.qcow2" "$VM"
    rm -f "$zip"
    say "VM disk ready: $VM"
  fi
fi

if [ "$VENV" = "$CACHE/venv-osworld" ]; then
  say "done; find_osworld_python() finds $VP (environment workers with python: auto run there)"
else
  say "done; export ARPO_OSWORLD_VENV=$VENV (or ARPO_OSWORLD_PYTHON=$VP) so that find_osworld_python() finds it"
fi
echo "$VP"
