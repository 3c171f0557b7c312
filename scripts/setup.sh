#!/usr/bin/env bash
# Idempotent set-up on Debian/Ubuntu: Chromium (apt), the project venv (.venv) and the tiny model.
# Fast when already done: pip runs only when pyproject.toml or this file changed.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '[setup] %s\n' "$*" >&2; }
sudo_if_needed() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# 1. The browser and its matching ChromeDriver, and for the test that runs generated pyautogui code
#    against a real window: a virtual X server and a clipboard tool.
#    - Debian: Debian's Chromium and chromium-driver (apt).
#    - Ubuntu (Colab's runtime is one): apt's chromium-browser is only a wrapper for a snap, and
#      snaps cannot run in a container; Google Chrome's own .deb instead (dl.google.com), and the
#      chromedriver of its version through Selenium Manager (step 2b, once the venv exists).
#    Picked by /etc/os-release (ID or ID_LIKE ubuntu) or by chromium being the snap wrapper;
#    ARPO_BROWSER=debian|google overrides. arpo_lib/envs/miniwob/browser.py finds whichever is installed.
. /etc/os-release 2>/dev/null || true
browser="${ARPO_BROWSER:-}"
if [ -z "$browser" ]; then
  browser=debian
  case " ${ID:-} ${ID_LIKE:-} " in *" ubuntu "*) browser=google ;; esac
  for name in chromium chromium-browser; do
    if command -v "$name" >/dev/null && head -c 4096 "$(command -v "$name")" | grep -qs snap; then browser=google; fi
  done
fi
case "$browser" in debian|google) ;; *) say "ERROR: ARPO_BROWSER must be debian or google, not $browser"; exit 1 ;; esac
CHROME_DEB_URL="https://dl.google.com/linux/direct/google-chrome-stable_current_amd64.deb"
if [ "$browser" = debian ]; then
  if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null \
      || ! command -v Xvfb >/dev/null || ! command -v xclip >/dev/null; then
    say "installing chromium, chromium-driver, xvfb and xclip with apt"
    sudo_if_needed apt-get update -qq
    sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver xvfb xclip >/dev/null
  fi
elif [ ! -x /opt/google/chrome/chrome ] || ! command -v Xvfb >/dev/null || ! command -v xclip >/dev/null; then
  say "installing Google Chrome (.deb from dl.google.com: apt's chromium here is a snap wrapper), xvfb and xclip"
  sudo_if_needed apt-get update -qq
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq xvfb xclip wget >/dev/null
  if [ ! -x /opt/google/chrome/chrome ]; then
    deb="$(mktemp -d)/google-chrome-stable_current_amd64.deb"
    wget -q -O "$deb" "$CHROME_DEB_URL" || { say "ERROR: could not download $CHROME_DEB_URL"; exit 1; }
    sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$deb" >/dev/null
    rm -f "$deb"
  fi
fi
#    The desktop environments (desktop/<task>): a sandbox (bubblewrap), a window manager, the tool
#    their set-up steps use (xdotool) and the suite's applications; without recommends (those
#    would add Qt, gvfs and icon themes: a larger install and other-looking screens).
#    libseccomp2 (the sandbox's seccomp filter, through pyseccomp), iptables (the 'user' isolation
#    fallback blocks the agent's network with it) and python3-tk (the system Python's tkinter, which
#    pyautogui imports: the test that runs the sandbox as an ordinary user uses that Python);
#    python3-pyatspi (with at-spi2-core and GTK's bridge, libatk-adaptor): the system Python reads
#    the accessibility tree that /accessibility serves (desktop_sandbox/a11y.py).
if ! command -v bwrap >/dev/null || ! command -v openbox >/dev/null || ! command -v xdotool >/dev/null \
    || ! command -v mousepad >/dev/null || ! command -v stterm >/dev/null || ! command -v pcmanfm >/dev/null \
    || ! command -v dbus-launch >/dev/null || ! PATH="$PATH:/usr/sbin:/sbin" command -v iptables >/dev/null \
    || ! ldconfig -p 2>/dev/null | grep -q libseccomp.so.2 \
    || { [ -x /usr/bin/python3 ] && ! /usr/bin/python3 -c "import tkinter" 2>/dev/null; } \
    || ! /usr/bin/python3 -I -c "import pyatspi" 2>/dev/null; then
  say "installing the desktop sandbox and applications with apt (bubblewrap openbox xdotool mousepad stterm pcmanfm dbus-x11 libseccomp2 iptables python3-tk python3-pyatspi)"
  sudo_if_needed apt-get update -qq
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    bubblewrap openbox xdotool mousepad stterm pcmanfm dbus-x11 libseccomp2 iptables python3-tk python3-pyatspi >/dev/null
fi
#    OSWorld's computer (desktop_sandbox/gnome.py, the default desktop of OSWorld's sandbox
#    provider): GNOME Shell with Ubuntu's look (Yaru, Ubuntu's dock), GNOME Terminal, Nautilus,
#    dconf and the settings daemon, the everyday tools of OSWorld's VM image that Debian has
#    (sysstat, jq, vim, a PulseAudio sound server), and user-mode networking (passt) for
#    env.options.network=user.
#    Without recommends: ~220 packages, ~150 MB to download, ~50 s. The Ubuntu font is in Debian's
#    non-free section: fetched with a temporary source list (the machine's own lists untouched).
GNOME_PKGS=(gnome-shell mutter gnome-session-bin gnome-terminal nautilus dconf-cli gnome-settings-daemon
            yaru-theme-gtk yaru-theme-icon yaru-theme-gnome-shell gnome-shell-extension-dashtodock
            sysstat jq vim passt pulseaudio pulseaudio-utils)
if ! command -v gnome-shell >/dev/null || ! command -v gnome-terminal >/dev/null || ! command -v sar >/dev/null \
    || ! command -v pasta >/dev/null || ! command -v jq >/dev/null || ! command -v vim >/dev/null \
    || ! command -v pactl >/dev/null \
    || [ ! -d /usr/share/gnome-shell/extensions/dash-to-dock@micxgx.gmail.com ] \
    || [ ! -d /usr/share/gnome-shell/theme/Yaru ] || [ ! -x /usr/libexec/gsd-media-keys ]; then
  say "installing OSWorld's desktop with apt (GNOME Shell, Yaru, Ubuntu's dock, GNOME Terminal, Nautilus, sysstat; ~150 MB)"
  sudo_if_needed apt-get update -qq
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${GNOME_PKGS[@]}" >/dev/null
fi
font_tried="${XDG_CACHE_HOME:-$HOME/.cache}/arpo-workbench/ubuntu-font-tried"
if [ ! -d /usr/share/fonts/truetype/ubuntu ] && [ "${ARPO_SKIP_UBUNTU_FONT:-0}" != 1 ] && [ ! -e "$font_tried" ]; then
  say "installing the Ubuntu font (Debian non-free: fonts-ubuntu)"
  apt_tmp="$(mktemp -d)"
  mkdir -p "$apt_tmp/lists/partial" "$apt_tmp/cache/archives/partial"
  . /etc/os-release 2>/dev/null || true
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
  mkdir -p "$(dirname "$font_tried")" && touch "$font_tried"  # tried once per machine: no retry at every command
fi

# 2. The Python environment.
PY="${ARPO_PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $PY"
  "$PY" -m venv .venv
fi
stamp=".venv/.setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  say "installing Python packages (first time: a few minutes)"
  # pip warns once per package about this machine's local wheel folders: not useful here.
  quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
  quiet .venv/bin/python -m pip install -q --upgrade pip
  # The CPU-runnable torch/torchvision pair (torchvision is needed by the Qwen-VL processors).
  quiet .venv/bin/python -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
  quiet .venv/bin/python -m pip install -q -e ".[notebooks,dev]"
  .venv/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null
  rm -f .venv/.setup-*
  touch "$stamp"
fi

# 2b. With Google Chrome: the chromedriver of its version, from Chrome for Testing through Selenium
#     Manager (into ~/.cache/selenium, where arpo_lib/envs/miniwob/browser.py looks), unless one is found.
if [ "$browser" = google ] && ! .venv/bin/python -m arpo_lib.envs.miniwob.browser 2>/dev/null | grep -q MINIWOB_CHROMEDRIVER; then
  .venv/bin/python -m arpo_lib.envs.miniwob.browser --fetch-driver >/dev/null
fi

# 3. The tiny UI-TARS-architecture models the smoke run and the tests use (deterministic, seconds).
for variant in qwen2vl qwen25vl; do
  if [ ! -f "models/tiny-uitars-$variant/.complete" ]; then
    say "building models/tiny-uitars-$variant"
    .venv/bin/python -m arpo_lib build-tiny-model --variant "$variant" --out "models/tiny-uitars-$variant"
  fi
done
# ... and the ~3.6M-parameter one of the ARPO-vs-GRPO experiment (configs/learning_miniwob.yaml).
if [ ! -f "models/small-uitars-qwen2vl/.complete" ]; then
  say "building models/small-uitars-qwen2vl"
  .venv/bin/python -m arpo_lib build-tiny-model --variant qwen2vl --size small --out models/small-uitars-qwen2vl
fi
