#!/usr/bin/env bash
# Idempotent, opt-in set-up of VS Code for OSWorld's vs_code tasks on the desktop sandbox, without
# Microsoft's servers: code-server (VS Code's open-source server, the same workbench in a browser
# page) from npm, shown in a Chromium application window by a `code` command (docs/vscode.md).
#   bash scripts/setup_vscode.sh             install into ~/.cache/arpo-workbench/vscode
#   bash scripts/setup_vscode.sh --dry-run   what it would install, nothing changed
#   bash scripts/setup_vscode.sh --check     the smoke check only: a VSIX installed and listed by
#                                            `code --list-extensions`, the server answering /healthz
# Installs: apt packages code-server's native modules build from (g++, make, python3, libkrb5-dev
# for kerberos), ripgrep (VS Code's search; its npm package would fetch a binary from GitHub, it is
# given Debian's instead), chromium; then `npm install code-server@4.100.3` (the last release whose
# engines field accepts node 20) into ARPO_VSCODE_HOME (default ~/.cache/arpo-workbench/vscode),
# with the native modules built against node's own headers (npm_config_nodedir), never downloaded.
# Leaves: ARPO_VSCODE_HOME/bin/code, ARPO_VSCODE_HOME/applications/code.desktop.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '[setup-vscode] %s\n' "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }
sudo_if_needed() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

DRY=0
CHECK_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --check) CHECK_ONLY=1 ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 0 ;;
    *) die "unknown argument $arg (see --help)" ;;
  esac
done

CODE_SERVER_VERSION=4.100.3
NODE_MAJOR=20  # code-server 4.100.3's postinstall refuses any other major version
APT_PKGS=(g++ make python3 libkrb5-dev ripgrep chromium)
HOME_DIR="${ARPO_VSCODE_HOME:-$HOME/.cache/arpo-workbench/vscode}"
PREFIX="$HOME_DIR/code-server"
PACKAGE="$PREFIX/node_modules/code-server"
MARKER="$PREFIX/.installed-$CODE_SERVER_VERSION"

smoke_check() {
  local home state port server listed status=0
  home="$(mktemp -d)"
  state="$home/state"
  mkdir -p "$state"
  # A VSIX as `vsce package` writes one for an extension without a publisher: undefined_publisher.test
  python3 - "$home/test.vsix" <<'EOF'
import json, sys, zipfile
manifest = ('<?xml version="1.0" encoding="utf-8"?><PackageManifest Version="2.0.0" '
            'xmlns="http://schemas.microsoft.com/developer/vsx-schema/2011"><Metadata><Identity '
            'Language="en-US" Id="test" Version="0.0.1" Publisher="undefined_publisher"/>'
            '<DisplayName>test</DisplayName></Metadata><Installation><InstallationTarget '
            'Id="Microsoft.VisualStudio.Code"/></Installation><Dependencies/><Assets><Asset '
            'Type="Microsoft.VisualStudio.Code.Manifest" Path="extension/package.json" '
            'Addressable="true"/></Assets></PackageManifest>')
with zipfile.ZipFile(sys.argv[1], "w") as vsix:
    vsix.writestr("extension.vsixmanifest", manifest)
    vsix.writestr("extension/package.json", json.dumps(
        {"name": "test", "version": "0.0.1", "engines": {"vscode": "^1.60.0"}}))
EOF
  HOME="$home" "$HOME_DIR/bin/code" --install-extension "$home/test.vsix" >"$state/install.log" 2>&1 || status=1
  listed="$(HOME="$home" "$HOME_DIR/bin/code" --list-extensions 2>/dev/null || true)"
  if [ "$status" = 0 ] && [[ $'\n'"$listed"$'\n' == *$'\nundefined_publisher.test\n'* ]]; then
    say "check: code --list-extensions lists the VSIX installed with code --install-extension"
  else
    say "check FAILED: the VSIX is not listed (see $state/install.log)"; status=1
  fi
  port="$(node -e 'const s=require("net").createServer().listen(0,"127.0.0.1",()=>{console.log(s.address().port);s.close()})')"
  HOME="$home" setsid node "$PACKAGE/out/node/entry.js" --config /dev/null --auth none \
    --bind-addr "127.0.0.1:$port" --user-data-dir "$home/.config/Code" \
    --extensions-dir "$home/.vscode/extensions" --session-socket "$state/session.sock" \
    >"$state/server.log" 2>&1 </dev/null &
  server=$!
  for _ in $(seq 1 300); do curl -fsS "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && break; sleep 0.1; done
  if curl -fsS "http://127.0.0.1:$port/healthz" >/dev/null 2>&1; then
    say "check: the server answers on 127.0.0.1:$port"
  else
    say "check FAILED: the server did not answer (log: $state/server.log)"; status=1
  fi
  kill -- -"$server" 2>/dev/null || true
  [ "$status" = 0 ] && rm -rf "$home"
  return "$status"
}

if [ "$CHECK_ONLY" = 1 ]; then
  [ -f "$MARKER" ] || die "code-server is not installed in $PREFIX (run this script without --check)"
  smoke_check
  exit
fi

# node: the major version code-server builds for, with its headers (nodesource's package has them)
command -v node >/dev/null || die "no node on PATH: code-server $CODE_SERVER_VERSION needs node $NODE_MAJOR"
command -v npm >/dev/null || die "no npm on PATH"
node_version="$(node --version)"
[ "${node_version%%.*}" = "v$NODE_MAJOR" ] || die "node $node_version: code-server $CODE_SERVER_VERSION needs node $NODE_MAJOR"
node_prefix="$(dirname "$(dirname "$(readlink -f "$(command -v node)")")")"
[ -f "$node_prefix/include/node/common.gypi" ] \
  || die "no node headers in $node_prefix/include/node: the native modules would fetch them from nodejs.org"

missing=()
for pkg in "${APT_PKGS[@]}"; do
  status="$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)"
  [[ "$status" == *"install ok installed"* ]] || missing+=("$pkg")
done

if [ "$DRY" = 1 ]; then
  say "node $node_version, headers in $node_prefix/include/node"
  say "apt: $([ ${#missing[@]} -gt 0 ] && echo "would install ${missing[*]}" || echo "nothing to install")"
  if [ -f "$MARKER" ]; then
    say "code-server $CODE_SERVER_VERSION is installed in $PREFIX"
  else
    say "would run: npm install code-server@$CODE_SERVER_VERSION in $PREFIX (about 42 MB from npm, 300 MB installed; its native modules compiled here)"
  fi
  say "would write $HOME_DIR/bin/code and $HOME_DIR/applications/code.desktop"
  exit 0
fi

if [ ${#missing[@]} -gt 0 ]; then
  say "apt: installing ${missing[*]}"
  sudo_if_needed apt-get update -qq
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [ -f "$MARKER" ]; then
  say "code-server $CODE_SERVER_VERSION is installed in $PREFIX"
else
  say "npm install code-server@$CODE_SERVER_VERSION into $PREFIX"
  rm -rf "$PREFIX"
  mkdir -p "$PREFIX"
  echo '{"private": true}' >"$PREFIX/package.json"
  # @vscode/ripgrep's postinstall takes its archive from a cache in the temporary directory before
  # it asks GitHub: that cache gets Debian's rg, under the name of the release it would fetch.
  build_tmp="$(mktemp -d)"
  rg_cache="$build_tmp/vscode-ripgrep-cache-1.15.11"
  mkdir -p "$rg_cache" "$build_tmp/rg"
  cp "$(command -v rg)" "$build_tmp/rg/rg"
  tar czf "$rg_cache/ripgrep-v13.0.0-10-x86_64-unknown-linux-musl.tar.gz" -C "$build_tmp/rg" rg
  # npm_config_nodedir: node-gyp builds against these headers instead of downloading them;
  # npm_config_yes: node-pty's post-install runs `npx node-gyp`, which asks otherwise;
  # npm_config_unsafe_perm: code-server's postinstall refuses root without it.
  if ! (cd "$PREFIX" && TMPDIR="$build_tmp" npm_config_nodedir="$node_prefix" npm_config_yes=true \
        npm_config_unsafe_perm=true npm install --no-audit --no-fund "code-server@$CODE_SERVER_VERSION" \
        >"$PREFIX/npm-install.log" 2>&1); then
    tail -n 30 "$PREFIX/npm-install.log" >&2
    die "npm install failed (the whole log: $PREFIX/npm-install.log)"
  fi
  rm -rf "$build_tmp"
  touch "$MARKER"
fi

mkdir -p "$HOME_DIR/bin" "$HOME_DIR/applications"
install -m 755 scripts/vscode/code "$HOME_DIR/bin/code"
cat >"$HOME_DIR/applications/code.desktop" <<EOF
[Desktop Entry]
Type=Application
Name=Visual Studio Code
Comment=Code Editing. Redefined.
GenericName=Text Editor
Exec=$HOME_DIR/bin/code %F
Icon=$PACKAGE/src/browser/media/pwa-icon-512.png
StartupWMClass=Code
Categories=TextEditor;Development;IDE;
MimeType=text/plain;inode/directory;application/x-code-workspace;
Keywords=vscode;
EOF
say "installed: $HOME_DIR/bin/code (code-server $CODE_SERVER_VERSION), $HOME_DIR/applications/code.desktop"
smoke_check
