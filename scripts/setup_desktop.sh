#!/usr/bin/env bash
# Idempotent, opt-in set-up of the applications OSWorld's tasks use, for the desktop sandbox
# (provider "sandbox": OSWorld without a VM). The default set-up (scripts/setup.sh) stays light.
#   ./workbench setup-desktop --osworld    (= bash scripts/setup_desktop.sh --osworld)
#   bash scripts/setup_desktop.sh --osworld --dry-run   what it would install, and the download size
# Installs with apt, without recommends: GNOME's Videos (Totem, the VM's default video player),
# LibreOffice (Calc, Writer, Impress, with libreoffice-gtk3: the VM's front end, GTK's file
# dialogs, and the only one that reaches the accessibility tree; one package of 0.5 MB, GTK 3
# being there with GNOME; the scripted solutions are written against it), GIMP, VLC, Thunderbird,
# wmctrl, socat, xsel, xclip, ffmpeg (the recording endpoints), xdg-utils; and the browser the
# tasks call `google-chrome`:
#   - Debian: Debian's Chromium (already there from the default set-up); inside the sandbox a
#     `google-chrome` shim runs it with Chrome's profile path (~/.config/google-chrome).
#   - Ubuntu (Colab's runtime is one): apt's chromium is a transitional package for a snap, and snaps
#     cannot run in a container without systemd. Google Chrome's own .deb is installed instead (as
#     OSWorld's VM image has Chrome), from dl.google.com; the shim then runs /opt/google/chrome/chrome.
#     Picked by /etc/os-release (ID=ubuntu or ID_LIKE containing ubuntu) or by chromium being a
#     snap wrapper; ARPO_DESKTOP_CHROME=google|debian overrides the choice.
# Then VS Code (scripts/setup_vscode.sh: code-server from npm, needs node 20; skipped with a warning
# where it cannot be set up): the sandbox stages it read-only at /opt/arpo/vscode with a `code` shim.
# What does not come from here: `python` with pyautogui inside the sandbox (the sandbox's own
# interpreter, staged from the workbench's, through a read-only shim), `sudo` (a shim: the VM's password, no privilege), the
# user `user` (the sandbox's identity files). OSWorld's evaluator code: ./workbench setup-osworld --light.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '[setup-desktop] %s\n' "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }
sudo_if_needed() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

OSWORLD=0
DRY=0
for arg in "$@"; do
  case "$arg" in
    --osworld) OSWORLD=1 ;;
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 0 ;;
    *) die "unknown argument $arg (see --help)" ;;
  esac
done
[ "$OSWORLD" = 1 ] || die "say which applications: --osworld (the default desktop comes with ./workbench setup)"

APPS=(libreoffice-calc libreoffice-writer libreoffice-impress libreoffice-gtk3 gimp vlc thunderbird totem wmctrl socat xsel xclip ffmpeg xdg-utils)
CHROME_DEB_URL="https://dl.google.com/linux/direct/google-chrome-stable_current_amd64.deb"

. /etc/os-release 2>/dev/null || true
chrome="${ARPO_DESKTOP_CHROME:-}"
if [ -z "$chrome" ]; then
  chrome=debian
  case " ${ID:-} ${ID_LIKE:-} " in *" ubuntu "*) chrome=google ;; esac
  if command -v chromium >/dev/null && grep -qs snap "$(command -v chromium)"; then chrome=google; fi
fi
case "$chrome" in debian|google) ;; *) die "ARPO_DESKTOP_CHROME must be google or debian, not $chrome" ;; esac
say "system: ${PRETTY_NAME:-unknown}; the browser: $([ "$chrome" = google ] && echo "Google Chrome's .deb" || echo "Debian's Chromium")"

apt_pkgs=()
for pkg in "${APPS[@]}"; do
  # captured, not piped into grep -q (under pipefail grep's early exit can fail dpkg-query)
  status="$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)"
  [[ "$status" == *"install ok installed"* ]] || apt_pkgs+=("$pkg")
done
need_chrome=0
[ "$chrome" = google ] && [ ! -x /opt/google/chrome/chrome ] && need_chrome=1
# VS Code for the vs_code tasks (code-server from npm in a Chromium window: docs/vscode.md), after
# the applications; it needs node 20, and a machine without it still gets everything else.
vscode() {
  bash scripts/setup_vscode.sh "$@" || say "WARNING: VS Code was not set up (above): OSWorld's vs_code tasks will not run in the sandbox"
}
if [ ${#apt_pkgs[@]} -eq 0 ] && [ "$need_chrome" = 0 ]; then
  say "the applications are installed already"
  if [ "$DRY" = 1 ]; then vscode --dry-run; else vscode; fi
  exit 0
fi
say "to install: ${apt_pkgs[*]}$([ "$need_chrome" = 1 ] && echo " google-chrome-stable (.deb)")"

if [ "$DRY" = 1 ]; then
  # apt's own estimate for this machine (it counts the dependencies not installed here yet)
  count="$(LC_ALL=C apt-get install -s --no-install-recommends "${apt_pkgs[@]}" 2>/dev/null | grep -c '^Inst' || true)"
  bytes="$(LC_ALL=C apt-get install --print-uris -y -qq --no-install-recommends "${apt_pkgs[@]}" 2>/dev/null \
    | awk "/^'/{s+=\$3} END {print s+0}")"
  say "apt would install $count packages (with their dependencies), $((bytes / 1000000)) MB to download"
  vscode --dry-run
  exit 0
fi

t0=$SECONDS
sudo_if_needed apt-get update -qq
if [ ${#apt_pkgs[@]} -gt 0 ]; then
  say "apt-get install --no-install-recommends ${apt_pkgs[*]} (about 270 MB to download on a machine with only the default set-up)"
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${apt_pkgs[@]}" >/dev/null \
    || die "apt-get install failed"
fi
if [ "$need_chrome" = 1 ]; then
  deb="$(mktemp -d)/google-chrome-stable_current_amd64.deb"
  say "downloading Google Chrome from $CHROME_DEB_URL"
  curl -fL --retry 3 -o "$deb" "$CHROME_DEB_URL" || die "could not download Google Chrome (no internet to dl.google.com?)"
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$deb" >/dev/null || die "installing Chrome failed"
fi
# Thunderbird on Ubuntu 24.04 and later is a transitional package for a snap, which cannot run here.
if command -v thunderbird >/dev/null && grep -qs snap "$(command -v thunderbird)"; then
  say "WARNING: thunderbird here is a snap wrapper: OSWorld's Thunderbird tasks will not run in the sandbox"
fi
say "installed in $((SECONDS - t0)) s"
vscode
