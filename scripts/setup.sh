#!/usr/bin/env bash
# Idempotent set-up on Debian/Ubuntu: what this machine's role needs, and nothing when all is there.
#   bash scripts/setup.sh [--role all|train|env] [--dry-run] [--force]
#   --role all    (default) everything: the browser, the desktop sandbox, the Python environment, the models
#   --role train  a machine that only trains (a GPU node): the Python environment and the models, no
#                 browser and no desktop stack (its environments run elsewhere, e.g. on Ray nodes)
#   --role env    a machine that only hosts environments: the browser and the desktop stack, and torch's
#                 CPU build (no CUDA wheels)
#   --dry-run     print what it finds and decides, and the commands it would run; change nothing
#   --force       reinstall the Python packages even if nothing changed
# The role is remembered (.venv/.arpo-role) for the set-up every ./workbench command runs first;
# ARPO_SETUP_ROLE overrides it. Which torch, and why: scripts/choose_torch.py (a working CUDA torch
# already installed, e.g. Colab's, is kept). ARPO_PYTHON_ENV=system (the default on Colab) installs into
# the base interpreter, which a notebook's kernel runs, with .venv layered on it; venv (elsewhere) keeps
# the packages in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '[setup] %s\n' "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }

ROLE="${ARPO_SETUP_ROLE:-}"
DRY=0
FORCE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --role) [ $# -ge 2 ] || die "--role needs all, train or env"; ROLE="$2"; shift ;;
    --role=*) ROLE="${1#--role=}" ;;
    --dry-run) DRY=1 ;;
    --force) FORCE=1 ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
  shift
done
ROLE_FILE=.venv/.arpo-role
[ -n "$ROLE" ] || ROLE="$(cat "$ROLE_FILE" 2>/dev/null || echo all)"
case "$ROLE" in all|train|env) ;; *) die "the role must be all, train or env, not $ROLE" ;; esac

# Runs a command, or in a dry run prints it.
run() {
  if [ "$DRY" = 1 ]; then printf '[setup] would run: %s\n' "$*" >&2; else "$@"; fi
}
sudo_if_needed() { if [ "$(id -u)" = 0 ]; then run "$@"; else run sudo "$@"; fi; }
# Presence checks never pipe into `grep -q`: under pipefail grep's early exit can fail the
# producer with SIGPIPE and a present thing would read as missing (and reach apt).
has_cmd() { PATH="$PATH:/usr/sbin:/sbin" command -v "$1" >/dev/null; }
has_lib() { local libs; libs="$(PATH="$PATH:/usr/sbin:/sbin" ldconfig -p 2>/dev/null || true)"; [[ "$libs" == *"$1"* ]]; }
is_snap_wrapper() { local head; head="$(head -c 4096 "$1" 2>/dev/null || true)"; [[ "$head" == *snap* ]]; }

# 1. System packages (roles all and env), gathered first and installed with one apt-get update.
APT=()
need() { APT+=("$@"); }
. /etc/os-release 2>/dev/null || true
browser="${ARPO_BROWSER:-}"
if [ -z "$browser" ]; then
  browser=debian
  case " ${ID:-} ${ID_LIKE:-} " in *" ubuntu "*) browser=google ;; esac
  for name in chromium chromium-browser; do
    if has_cmd "$name" && is_snap_wrapper "$(command -v "$name")"; then browser=google; fi
  done
fi
case "$browser" in debian|google) ;; *) die "ARPO_BROWSER must be debian or google, not $browser" ;; esac
CHROME_DEB_URL="https://dl.google.com/linux/direct/google-chrome-stable_current_amd64.deb"
need_chrome_deb=0
if [ "$ROLE" != train ]; then
  # The browser and its matching ChromeDriver, a virtual X server and a clipboard tool.
  #  - Debian: Debian's Chromium and chromium-driver.
  #  - Ubuntu (Colab's runtime is one): apt's chromium-browser is only a wrapper for a snap, and snaps
  #    cannot run in a container; Google Chrome's own .deb instead (dl.google.com), and the chromedriver
  #    of its version through Selenium Manager (step 2b). Picked by /etc/os-release (ID or ID_LIKE
  #    ubuntu) or by chromium being the snap wrapper; ARPO_BROWSER=debian|google overrides.
  has_cmd Xvfb || need xvfb
  has_cmd xclip || need xclip
  if [ "$browser" = debian ]; then
    has_cmd chromium || need chromium
    has_cmd chromedriver || need chromium-driver
  elif [ ! -x /opt/google/chrome/chrome ]; then
    need_chrome_deb=1
    has_cmd wget || need wget
  fi
  # The desktop environments (desktop/<task>): a sandbox (bubblewrap), a window manager, the tool their
  # set-up steps use (xdotool) and the suite's applications; libseccomp2 (the sandbox's seccomp filter,
  # through pyseccomp), iptables (the 'user' isolation fallback blocks the agent's network with it),
  # python3-tk (the system Python's tkinter, which pyautogui imports: the sandbox run as an ordinary user
  # uses that Python), python3-pyatspi (the accessibility tree desktop_sandbox/a11y.py serves),
  # fuse-overlayfs (the writable system layer of root inside, env.options.sudo=root: desktop_sandbox/superuser.py).
  has_cmd bwrap || need bubblewrap
  has_cmd fuse-overlayfs || need fuse-overlayfs
  has_cmd openbox || need openbox
  has_cmd xdotool || need xdotool
  has_cmd mousepad || need mousepad
  has_cmd stterm || need stterm
  has_cmd pcmanfm || need pcmanfm
  has_cmd dbus-launch || need dbus-x11
  has_cmd iptables || need iptables
  has_lib libseccomp.so.2 || need libseccomp2
  if [ -x /usr/bin/python3 ]; then
    /usr/bin/python3 -c "import tkinter" 2>/dev/null || need python3-tk
    /usr/bin/python3 -I -c "import pyatspi" 2>/dev/null || need python3-pyatspi
  fi
  # OSWorld's computer (desktop_sandbox/gnome.py): GNOME Shell with Ubuntu's look (Yaru, Ubuntu's dock),
  # GNOME Terminal, Nautilus, Settings (gnome-control-center), gedit (the VM's text editor), dconf and the
  # settings daemon, the everyday tools of OSWorld's VM image that Debian has, and user-mode networking (passt)
  # for env.options.network=user. ~220 packages, ~150 MB, Settings 42 more, 107 MB installed, gedit 10 more (Debian 12).
  gnome_ok=1
  for c in gnome-shell gnome-terminal gnome-control-center gedit sar pasta jq vim pactl; do has_cmd "$c" || gnome_ok=0; done
  [ -d /usr/share/gnome-shell/extensions/dash-to-dock@micxgx.gmail.com ] || gnome_ok=0
  [ -d /usr/share/gnome-shell/theme/Yaru ] || gnome_ok=0
  [ -x /usr/libexec/gsd-media-keys ] || gnome_ok=0
  [ "$gnome_ok" = 1 ] || need gnome-shell mutter gnome-session-bin gnome-terminal nautilus gnome-control-center gedit dconf-cli \
    gnome-settings-daemon yaru-theme-gtk yaru-theme-icon yaru-theme-gnome-shell gnome-shell-extension-dashtodock \
    sysstat jq vim passt pulseaudio pulseaudio-utils
fi
if [ ${#APT[@]} -gt 0 ] || [ "$need_chrome_deb" = 1 ]; then
  say "installing with apt (role $ROLE): ${APT[*]:-}$([ "$need_chrome_deb" = 1 ] && echo " google-chrome-stable (.deb)")"
  sudo_if_needed apt-get update -qq
  if [ ${#APT[@]} -gt 0 ]; then
    sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${APT[@]}"
  fi
  if [ "$need_chrome_deb" = 1 ]; then
    deb="$(mktemp -d)/google-chrome-stable_current_amd64.deb"
    run wget -q -O "$deb" "$CHROME_DEB_URL" || die "could not download $CHROME_DEB_URL"
    sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$deb"
  fi
elif [ "$DRY" = 1 ]; then
  say "system packages: nothing missing for role $ROLE"
fi
# The Ubuntu font is in Debian's non-free section: fetched with a temporary source list (the machine's
# own lists untouched), tried once per machine.
font_tried="${XDG_CACHE_HOME:-$HOME/.cache}/arpo-workbench/ubuntu-font-tried"
if [ "$ROLE" != train ] && [ ! -d /usr/share/fonts/truetype/ubuntu ] && [ "${ARPO_SKIP_UBUNTU_FONT:-0}" != 1 ] \
    && [ ! -e "$font_tried" ]; then
  say "installing the Ubuntu font (Debian non-free: fonts-ubuntu)"
  if [ "$DRY" = 1 ]; then
    run apt-get download fonts-ubuntu "(from deb.debian.org ${VERSION_CODENAME:-bookworm} non-free)"
  else
    apt_tmp="$(mktemp -d)"
    mkdir -p "$apt_tmp/lists/partial" "$apt_tmp/cache/archives/partial"
    echo "deb http://deb.debian.org/debian ${VERSION_CODENAME:-bookworm} non-free" > "$apt_tmp/sources.list"
    apt_opts=(-o Dir::Etc::sourcelist="$apt_tmp/sources.list" -o Dir::Etc::sourceparts=- -o Dir::State::Lists="$apt_tmp/lists"
              -o Dir::Cache="$apt_tmp/cache" -o APT::Get::List-Cleanup=0)
    if (cd "$apt_tmp" && sudo_if_needed apt-get "${apt_opts[@]}" update -qq >/dev/null 2>&1 \
        && sudo_if_needed apt-get "${apt_opts[@]}" download fonts-ubuntu >/dev/null 2>&1); then
      sudo_if_needed dpkg -i "$apt_tmp"/fonts-ubuntu_*.deb >/dev/null || say "WARNING: the Ubuntu font did not install (DejaVu stands in)"
    else
      say "WARNING: could not fetch fonts-ubuntu from Debian's non-free section (DejaVu stands in; ARPO_SKIP_UBUNTU_FONT=1 skips this)"
    fi
    sudo_if_needed rm -rf "$apt_tmp"
    mkdir -p "$(dirname "$font_tried")" && touch "$font_tried"
  fi
fi

# 2. The Python environment. The base interpreter: $ARPO_PYTHON, else python3.11, else python3.
# (.venv's own bin/ is left out of the search: a command run inside the activated environment, a
# notebook's kernel, must find the same base interpreter as one run outside it)
BASE_PATH=""
IFS=: read -ra path_dirs <<< "$PATH"
for d in "${path_dirs[@]}"; do [ "$d" = "$PWD/.venv/bin" ] || BASE_PATH="${BASE_PATH:+$BASE_PATH:}$d"; done
PY="${ARPO_PYTHON:-$(PATH="$BASE_PATH" command -v python3.11 || PATH="$BASE_PATH" command -v python3)}"
PY_ENV="${ARPO_PYTHON_ENV:-$([ -n "${COLAB_RELEASE_TAG:-}" ] && echo system || echo venv)}"
case "$PY_ENV" in venv|system) ;; *) die "ARPO_PYTHON_ENV must be venv or system, not $PY_ENV" ;; esac
EXTRAS="$([ "$ROLE" = env ] && echo dev || echo notebooks,dev)"
stamp=".venv/.setup-$(cat pyproject.toml scripts/setup.sh scripts/choose_torch.py \
  | cat - <(echo "$ROLE $PY_ENV $PY ${ARPO_TORCH:-} ${ARPO_TORCH_INDEX:-}") | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$FORCE" = 1 ] || [ "$DRY" = 1 ]; then
  [ -f "$stamp" ] && [ "$DRY" = 1 ] && say "Python packages: up to date (a fresh set-up would decide as follows)"
  decision="$("$PY" scripts/choose_torch.py --role "$ROLE" --python "$PY")" || die "scripts/choose_torch.py failed"
  eval "$decision"
  [ "$TORCH_ACTION" = error ] && die "$TORCH_REASON"
  say "role $ROLE; Python: $PY ($PY_ENV); torch: $TORCH_REASON"
  if [ "$PY_ENV" = system ]; then
    # .venv only points at the base interpreter (a notebook's kernel and ./workbench then run the same
    # Python, with the same packages): bin/python runs it, bin/activate puts bin/ first on PATH.
    if [ "$(cat .venv/.system-python 2>/dev/null)" != "$PY" ]; then
      say "pointing .venv at $PY (packages go into that interpreter)"
      if [ "$DRY" = 1 ]; then
        run write .venv/bin/python "(exec $PY)" and .venv/bin/activate
      else
        rm -rf .venv && mkdir -p .venv/bin
        printf '#!/bin/sh\nexec %q "$@"\n' "$PY" > .venv/bin/python
        chmod +x .venv/bin/python && ln -s python .venv/bin/python3
        printf 'export VIRTUAL_ENV=%q\nexport PATH="$VIRTUAL_ENV/bin:$PATH"\n' "$PWD/.venv" > .venv/bin/activate
        echo "$PY" > .venv/.system-python
      fi
    fi
  elif [ ! -x .venv/bin/python ] || [ -f .venv/.system-python ]; then
    [ -e .venv ] && run rm -rf .venv
    say "creating .venv with $PY$([ "$TORCH_LAYER_ON_BASE" = 1 ] && echo ", layered on its packages (its torch)")"
    run "$PY" -m venv $([ "$TORCH_LAYER_ON_BASE" = 1 ] && echo --system-site-packages) .venv
  elif [ "$TORCH_LAYER_ON_BASE" = 1 ] && ! grep -qsx "include-system-site-packages = true" .venv/pyvenv.cfg; then
    say "layering .venv on $PY's packages (include-system-site-packages: its torch)"
    run sed -i 's/^include-system-site-packages = .*/include-system-site-packages = true/' .venv/pyvenv.cfg
  fi
  # system: into the base interpreter (the one a notebook's kernel runs); venv: into .venv
  pip=("$([ "$PY_ENV" = system ] && echo "$PY" || echo .venv/bin/python)" -m pip)
  constraints=.venv/.torch-constraints.txt
  if [ "$DRY" = 1 ]; then
    say "would pin torch with: ${TORCH_CONSTRAINTS[*]:-the installed versions}"
  else
    say "installing Python packages (first time: a few minutes)"
  fi
  # pip warns once per package about this machine's local wheel folders: not useful here.
  quiet() { if [ "$DRY" = 1 ]; then run "$@"; else "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; fi; }
  [ "$PY_ENV" = venv ] && quiet "${pip[@]}" install -q --upgrade pip
  if [ "$TORCH_ACTION" = install ]; then
    quiet "${pip[@]}" install -q "${TORCH_PIP_ARGS[@]}"
  fi
  if [ "$DRY" = 0 ]; then
    # The torch chosen (kept or just installed) stays: the project's own requirements cannot swap it.
    if [ ${#TORCH_CONSTRAINTS[@]} -gt 0 ]; then
      printf '%s\n' "${TORCH_CONSTRAINTS[@]}" > "$constraints"
    else
      "${pip[0]}" - > "$constraints" <<'PINS'
import torch, torchvision
for name, module in (("torch", torch), ("torchvision", torchvision)):
    print(f"{name}=={module.__version__.split('+')[0]}")
PINS
    fi
  fi
  quiet "${pip[@]}" install -q -e ".[$EXTRAS]" -c "$constraints"
  [ "$PY_ENV" = venv ] && [ "$ROLE" != env ] && run .venv/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null
  if [ "$DRY" = 0 ]; then
    rm -f .venv/.setup-*
    touch "$stamp"
  fi
fi
[ "$DRY" = 1 ] || echo "$ROLE" > "$ROLE_FILE"

# 2b. With Google Chrome: the chromedriver of its version, from Chrome for Testing through Selenium
#     Manager (into ~/.cache/selenium, where arpo_lib/envs/miniwob/browser.py looks), unless one is found.
if [ "$ROLE" != train ] && [ "$browser" = google ]; then
  found="$(.venv/bin/python -m arpo_lib.envs.miniwob.browser 2>/dev/null || true)"
  [[ "$found" == *MINIWOB_CHROMEDRIVER* ]] || run .venv/bin/python -m arpo_lib.envs.miniwob.browser --fetch-driver >/dev/null
fi

# 3. The tiny UI-TARS-architecture models the smoke run, the notebooks' defaults and the tests use
#    (deterministic, seconds), and the ~3.6M-parameter one of the learning study.
for variant in qwen2vl qwen25vl; do
  if [ ! -f "models/tiny-uitars-$variant/.complete" ]; then
    say "building models/tiny-uitars-$variant"
    run .venv/bin/python -m arpo_lib build-tiny-model --variant "$variant" --out "models/tiny-uitars-$variant"
  fi
done
if [ ! -f "models/small-uitars-qwen2vl/.complete" ]; then
  say "building models/small-uitars-qwen2vl"
  run .venv/bin/python -m arpo_lib build-tiny-model --variant qwen2vl --size small --out models/small-uitars-qwen2vl
fi
