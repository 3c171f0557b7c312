"""What confines a desktop sandbox, computed on the host: the file system the sandbox sees, its
environment variables, the seccomp filter, the resource limits, and which isolation mode can run
on this machine. sandbox.py turns these into one process; server.py applies the limits inside.

The promise (docs/desktop.md, "Threat model"): a hostile agent, whatever it types, saves or clicks,
reads nothing of the host beyond the system trees listed here (and of /etc only what every user of
the host may read, minus known secrets), writes nothing to the host, reaches no network and no host
socket, cannot reach the control API, runs no code through the action channel but whitelisted
pyautogui calls, and is bounded in processes, memory, file size and disk.

Two isolation modes:
- `namespaces` (bubblewrap; the default wherever user namespaces work, as root or as an ordinary
  user): new user, PID, network, IPC, UTS and mount namespaces, a read-only view of the listed host
  trees, size-capped tmpfs for every writable directory, a seccomp filter, no nested namespaces.
- `user` (the fallback where user namespaces are refused, e.g. a container runtime that forbids
  them; needs root): the agent's programs run as a dedicated unprivileged uid with its own home
  and a clean environment. It loses the mount, PID and network namespaces: see `USER_MODE_LOSSES`.
"""
from __future__ import annotations

import functools
import os
import shlex
import shutil
import stat
import subprocess
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, BinaryIO

HOME_IN_SANDBOX = "/home/user"
HOSTNAME = "user-virtual-machine"
"""The sandbox's hostname: OSWorld's VM's (its terminal prompt reads user@user-virtual-machine)."""
USER_ID = 1000
"""The sandbox's own user `user` (namespaces mode: uid 1000 inside, mapped to the caller outside)."""
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
ISOLATION_MODES = ("auto", "namespaces", "user")


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandbox. Every field is a config key under `env.options.limits`."""

    pids: int = 1024
    """Processes and threads the episode's programs may have at once (Chromium alone runs ~150
    threads). Watched by the action server (processes every 0.05 s, threads every 0.25 s; above it, every program of the episode is
    ended) and, where the kernel applies it (a caller other than root), RLIMIT_NPROC."""
    memory_mib: int = 4096
    """Data memory of any one process (RLIMIT_DATA: heap and private mappings)."""
    total_memory_mib: int = 8192
    """Resident memory of the episode's programs together (watched like `pids`)."""
    file_mib: int = 1024
    """Largest file any process may write (RLIMIT_FSIZE)."""
    action_cpu_s: int = 20
    """CPU seconds one agent action may use (RLIMIT_CPU of the action's process)."""
    home_mib: int = 1024
    """Size of the home directory (a tmpfs: nothing the agent writes lands on the host's disk)."""
    scratch_mib: int = 256
    """Size of each scratch directory: /tmp, /run, /var/tmp and /dev/shm (tmpfs each)."""
    system_mib: int = 2048
    """With root inside (`sudo: root`): size of the writable layer over the system directories (a
    tmpfs: what root installs or changes there is held in memory, and gone at the next reset)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"limits.{f.name} must be a positive integer, got {value!r}")
        if self.pids < 64:
            raise ValueError(f"limits.pids must be >= 64 (the desktop itself needs ~20), got {self.pids}")

    @classmethod
    def from_options(cls, value: "Limits | dict[str, Any] | None") -> "Limits":
        """From a config mapping; an unknown key is an error naming it."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown desktop limit(s) {unknown}: known are {sorted(known)}")
        return cls(**value)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


# ---- what this machine offers --------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def process_uid(pid: int | str) -> int | None:
    """The real uid of process `pid` (/proc/<pid>/status), None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
    except (OSError, StopIteration, ValueError):
        return None


def bwrap_features() -> frozenset[str]:
    """The bubblewrap options this machine's bwrap knows, of those the sandbox uses when present:
    `--size` (sized tmpfs, bubblewrap >= 0.7) and `--disable-userns` (>= 0.8)."""
    if not shutil.which("bwrap"):
        return frozenset()
    text = subprocess.run(["bwrap", "--help"], capture_output=True, text=True).stdout
    return frozenset(option for option in ("--size", "--disable-userns") if option in text)


@functools.lru_cache(maxsize=None)
def user_namespaces_refused() -> str | None:
    """Why bubblewrap cannot create a user namespace here, or None when it can."""
    if not shutil.which("bwrap"):
        return "bubblewrap is not installed"
    probe = subprocess.run(["bwrap", "--unshare-all", "--unshare-user", "--die-with-parent", "--ro-bind", "/", "/",
                            "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else (probe.stderr.strip()[:300] or f"exit {probe.returncode}")


def choose_isolation(requested: str = "auto") -> str:
    """The isolation mode to run: `requested`, or for "auto" namespaces where user namespaces work,
    else the dedicated-user fallback when running as root. Raises RuntimeError naming the fix."""
    if requested not in ISOLATION_MODES:
        raise ValueError(f"isolation must be one of {ISOLATION_MODES}, got {requested!r}")
    refused = user_namespaces_refused()
    if requested == "namespaces" or (requested == "auto" and refused is None):
        if refused is not None:
            raise RuntimeError(f"bubblewrap cannot create namespaces here: {refused}. {USERNS_FIXES}")
        return "namespaces"
    if os.geteuid() != 0:
        raise RuntimeError(f"no isolation mode can run here: user namespaces are refused ({refused}) and the "
                           f"dedicated-user fallback needs root. {USERNS_FIXES}")
    return "user"


USERNS_FIXES = ("Fixes: on Ubuntu 24.04, allow bubblewrap user namespaces (sysctl "
                "kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile for bwrap); in a "
                "container, run it with user namespaces allowed (e.g. Docker's --security-opt "
                "seccomp=unconfined); as root, env.options.isolation=user runs the dedicated-user fallback.")

USER_MODE_LOSSES = (
    "no mount namespace: the agent's programs can read every world-readable host file and write the "
    "host's world-writable directories (/tmp, /var/tmp, /dev/shm); only files no other user may read "
    "(mode 0600 and the like, /root) stay out of reach",
    "no PID namespace: the agent sees the host's process list and command lines",
    "no network namespace: the network is blocked for the agent's uid only where iptables can be used "
    "(root with netfilter); otherwise the agent reaches the network and host services on loopback",
    "no size-capped home: disk use is bounded per file (limits.file_mib), not in total",
    "no seccomp filter: the kernel's whole system-call surface is open to an unprivileged uid",
)
"""What the `user` fallback does not promise that `namespaces` does (docs/desktop.md repeats it)."""


# ---- the file system a sandbox sees ---------------------------------------------------------------

ETC_SECRETS = ("environment", "ssh", "shadow", "shadow-", "gshadow", "gshadow-", "sudoers", "sudoers.d",
               "ssl/private", "apt/auth.conf", "apt/auth.conf.d", "security/opasswd", "krb5.keytab",
               "credstore", "credstore.encrypted", "wireguard", "NetworkManager/system-connections",
               "letsencrypt", "docker", "containerd", "kubernetes", "rancher", "boto.cfg", "wgetrc", "netrc",
               "machine-id", "hostname", "hosts", "resolv.conf", "passwd", "group", "passwd-", "group-")
"""Under /etc, hidden even when world-readable: credentials, keys and host identity. (passwd, group,
hostname, hosts and machine-id are replaced by the sandbox's own.)"""
SYSTEM_TREES = ("/usr", "/etc", "/opt/google")
"""Host trees the sandbox sees read-only (those that exist): programs, libraries, fonts,
configuration, and Google Chrome where its .deb is installed. Nothing else of the host."""
ROOT_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
"""Top-level entries that merged-/usr systems make symlinks into /usr (bound when real directories)."""
READ_ONLY_EXTRAS = ("/var/cache/fontconfig", "/var/lib/dpkg", "/var/lib/apt/lists")
"""Small host caches applications read (fontconfig rebuilds its cache in every fresh home without
it), and the package database with apt's lists: what is installed, as `dpkg -l`, `apt list
--installed` and OSWorld's checkers ask (read-only: nothing can be installed from inside)."""
SCRATCH_DIRS = ("/tmp", "/run", "/var/tmp", "/dev/shm")


def unreadable_for_others(root: str = "/etc") -> list[tuple[str, str]]:
    """Entries under `root` that an unprivileged other user of the host could not read: ("dir" or
    "file", path), directories not descended into. The sandbox's uid maps to the caller, who may be
    root, so its own permission checks would let these through: they are masked instead."""
    masked: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        keep = []
        for name in dirnames:
            path = os.path.join(dirpath, name)
            try:
                mode = os.lstat(path).st_mode
            except OSError:
                continue
            if stat.S_ISLNK(mode):
                continue
            if mode & (stat.S_IROTH | stat.S_IXOTH) != (stat.S_IROTH | stat.S_IXOTH):
                masked.append(("dir", path))
            else:
                keep.append(name)
        dirnames[:] = keep
        for name in filenames:
            path = os.path.join(dirpath, name)
            try:
                mode = os.lstat(path).st_mode
            except OSError:
                continue
            if not stat.S_ISLNK(mode) and not mode & stat.S_IROTH:
                masked.append(("file", path))
    return masked


def etc_masks() -> tuple[tuple[str, str], ...]:
    """("dir" | "file", path) under /etc to hide: the unreadable ones and ETC_SECRETS. Walked at
    every sandbox start (~25 ms): /etc changes while a process runs (a package installed, a secret
    added), and a mask of a file that is gone stops bubblewrap."""
    masks = dict((path, kind) for kind, path in unreadable_for_others("/etc"))
    for name in ETC_SECRETS:
        path = f"/etc/{name}"
        if os.path.lexists(path) and not any(path.startswith(m + "/") for m in masks):
            masks[path] = "dir" if os.path.isdir(path) and not os.path.islink(path) else "file"
    return tuple(sorted((kind, path) for path, kind in masks.items()))


def python_paths() -> list[str]:
    """Host directories the sandbox's Python needs, read-only at the same paths: the interpreter's
    installation, the virtual environment and any site-packages directory on sys.path outside
    them (where pyautogui, python-xlib, Pillow and pyseccomp live). The outermost ones only;
    those under /usr are visible already."""
    candidates = {sys.prefix, sys.base_prefix, str(Path(sys.executable).resolve().parent.parent)}
    candidates |= {p for p in sys.path if p and os.path.basename(p) in ("site-packages", "dist-packages")}
    return _outermost(candidates)


def site_directories() -> list[str]:
    """The site-packages directories on this interpreter's sys.path (those PYTHONPATH adds
    included): the sandbox's isolated interpreters (-I ignores PYTHONPATH) put them back."""
    return [p for p in dict.fromkeys(sys.path)
            if p and os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p)]


def package_dir() -> str:
    """This package (desktop_sandbox) on the host: the only part of the repository the sandbox sees."""
    return str(Path(__file__).resolve().parent)


def _outermost(paths: set[str]) -> list[str]:
    real = {q for p in paths if p and os.path.isdir(p) for q in (os.path.abspath(p), os.path.realpath(p))}
    real = {p for p in real if not _covered(p)}
    return sorted(p for p in real if not any(p.startswith(q + "/") for q in real))


def _covered(path: str) -> bool:
    return any(path == t or path.startswith(t + "/") for t in SYSTEM_TREES if os.path.isdir(t))


CAPS_ROOT_NEVER_HAS = ("CAP_SYS_PTRACE", "CAP_NET_ADMIN")
"""With root inside: capabilities its processes never get (sudo.py says why; its init drops them
from the bounding set too)."""
SCRATCH_MODES = {"/tmp": 0o1777, "/var/tmp": 0o1777, "/dev/shm": 0o1777, "/run": 0o755}
"""With root inside: the scratch directories belong to root, as on the VM (sudo.py gives `user` what
the desktop writes under /run)."""


def bwrap_arguments(workdir: Path, limits: Limits, *, network: bool = False, seccomp_fd: int | None = None,
                    binds: dict[str, str] | None = None, environment: dict[str, str] | None = None,
                    system_root: str | None = None) -> list[str]:
    """The bubblewrap options (everything before the command) of a namespaces-mode sandbox.
    `workdir` holds the sandbox's own passwd, group, hostname, hosts and machine-id files
    (write_identity_files); `binds` (host path: path inside, read-only) the sandbox's Python
    (runtime.py) and anything else its caller adds.

    `system_root`: root inside (superuser.py). bubblewrap then runs as root of the user namespace
    made for it, in the network namespace made for it, and that overlay is the sandbox's `/`, the
    system trees, the masks and the identity files in it; the command starts as root (sudo.py)."""
    features = bwrap_features()
    as_root = system_root is not None
    args = ["--die-with-parent", "--new-session", *(() if as_root else ("--unshare-user",)), "--unshare-pid",
            "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--hostname", HOSTNAME,
            *(() if as_root else ("--uid", str(USER_ID), "--gid", str(USER_ID))), "--clearenv"]
    if as_root:
        args += [part for cap in CAPS_ROOT_NEVER_HAS for part in ("--cap-drop", cap)]
        args += ["--bind", system_root, "/"]
    else:
        if not network:
            args.append("--unshare-net")
        if "--disable-userns" in features:
            args.append("--disable-userns")
        for tree in SYSTEM_TREES:
            if os.path.isdir(tree):
                args += ["--ro-bind", tree, tree]
        for name in ROOT_LINKS:
            path = f"/{name}"
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        for kind, path in etc_masks():
            args += ["--tmpfs", path, "--remount-ro", path] if kind == "dir" else ["--ro-bind", "/dev/null", path]
        for name in IDENTITY_FILES:
            args += ["--ro-bind", str(workdir / name), f"/etc/{name}"]
    if as_root:  # bubblewrap makes the parents of a mount point 0700, which are then root's alone
        args += world_readable_parents([SHIM_DIR_IN_SANDBOX, *(binds or {}).values()])
    if (workdir / "bin").is_dir():  # write_python_shim
        args += ["--ro-bind", str(workdir / "bin"), SHIM_DIR_IN_SANDBOX]
    args += ["--proc", "/proc", "--dev", "/dev"]
    for path in () if as_root else READ_ONLY_EXTRAS:
        if os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path, mib in [*((d, limits.scratch_mib) for d in SCRATCH_DIRS), (HOME_IN_SANDBOX, limits.home_mib)]:
        args += ["--perms", f"{SCRATCH_MODES.get(path, 0o755):o}"] if as_root else []
        args += (["--size", str(mib * 2**20)] if "--size" in features else []) + ["--tmpfs", path]
    args += ["--symlink", "../run", "/var/run", "--symlink", "../run/lock", "/var/lock"]
    for outside, inside in (binds or {}).items():  # after the tmpfs mounts, which could hide them
        args += ["--ro-bind", outside, inside]
    for name, value in (environment or sandbox_environment()).items():
        args += ["--setenv", name, value]
    # With root inside `/` stays writable, to root: the overlay (`user` may write none of it).
    args += ["--remount-ro", "/dev", *(() if as_root else ("--remount-ro", "/")), "--chdir", HOME_IN_SANDBOX]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    return args


def world_readable_parents(destinations: list[str]) -> list[str]:
    """bubblewrap options making each missing parent directory of `destinations` 0755 (those that
    exist are left as they are)."""
    parents = {str(parent) for path in destinations for parent in Path(path).parents if str(parent) != "/"}
    return [part for parent in sorted(parents) for part in ("--perms", "755", "--dir", parent)]


IDENTITY_FILES = ("passwd", "group", "hostname", "hosts", "machine-id")


def write_identity_files(workdir: Path, uid: int = USER_ID, home: str = HOME_IN_SANDBOX) -> None:
    """The sandbox's own /etc/passwd, group, hostname, hosts and machine-id (read-only inside)."""
    (workdir / "passwd").write_text(f"user:x:{uid}:{uid}:Desktop user:{home}:/bin/bash\n"
                                    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
    (workdir / "group").write_text(f"user:x:{uid}:\nnogroup:x:65534:\n")
    (workdir / "hostname").write_text(f"{HOSTNAME}\n")
    (workdir / "hosts").write_text(f"127.0.0.1\tlocalhost\n127.0.1.1\t{HOSTNAME}\n::1\tlocalhost\n")
    (workdir / "machine-id").write_text(os.urandom(16).hex() + "\n")


SHIM_DIR_IN_SANDBOX = "/opt/arpo/bin"
"""Where the sandbox sees the host-written `python` shim (read-only)."""
VSCODE_IN_SANDBOX = "/opt/arpo/vscode"
"""Where the sandbox sees VS Code (code-server and its `code` command, scripts/setup_vscode.sh), read-only."""


def vscode_home() -> str | None:
    """VS Code's installation on this host (scripts/setup_vscode.sh): $ARPO_VSCODE_HOME, else the
    workbench's cache (~/.cache/arpo-workbench/vscode); None where it is not installed."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "arpo-workbench" / "vscode"
    home = os.environ.get("ARPO_VSCODE_HOME") or str(cache)
    return home if os.access(os.path.join(home, "bin", "code"), os.X_OK) else None


def write_python_shim(workdir: Path, python: str, site_dirs: list[str], pythons: bool = True,
                      environment: dict[str, str] | None = None, vscode: str | None = None,
                      sudo_client: str | None = None) -> Path:
    """`workdir/bin/python` and `python3`: OSWorld's set-up steps and getters run `python -c "import pyautogui;
    ..."` (the name `python`, with pyautogui importable). The shim runs `python` with `site_dirs`:
    in namespaces mode the sandbox's staged interpreter and site (runtime.py), in user mode the
    workbench's own. It is written by the host and seen read-only, so nothing the agent
    does can change what a trusted command runs. `pythons=False`: the browser shims only (the
    agent's uid cannot run `python`: user mode with the interpreter in a directory only root may
    enter). `environment`: what the interpreter needs besides (runtime.Runtime.environment).
    `vscode`: where the sandbox sees VS Code, for a `code` command and its desktop entry.
    `sudo_client`: with root inside, how `sudo` runs sudo.py's client (`sudo_root_shim`)."""
    bin_dir = workdir / "bin"
    bin_dir.mkdir(exist_ok=True)
    bin_dir.chmod(0o755)  # whatever the umask: the sandbox's uid may be an unprivileged one
    path = ":".join(site_dirs)
    for name in ("python", "python3") if pythons else ():  # OSWorld's VM has pyautogui under both names (GIMP's tasks use python3)
        shim = bin_dir / name
        shim.write_text("#!/bin/sh\n# OSWorld's commands run python and python3 with pyautogui: the sandbox's interpreter\n"
                        + "".join(f"{k}={shlex.quote(v)} " for k, v in (environment or {}).items())
                        + f"PYTHONPATH={shlex.quote(path)} exec {shlex.quote(python)} \"$@\"\n")
        shim.chmod(0o755)
    sudo = bin_dir / "sudo"
    sudo.write_text(SUDO_SHIM if sudo_client is None else sudo_root_shim(sudo_client))
    sudo.chmod(0o755)
    chromium = next((p for p in CHROMIUM_BINARIES if os.access(p, os.X_OK)), None)
    if chromium:  # OSWorld's tasks start `google-chrome` and end it with `pkill chrome`; its profile
        # getters read ~/.config/google-chrome. A script named `chrome` (a script's process carries
        # its own name; a link would carry the binary's) runs Debian's Chromium with Chrome's profile
        # path and passes the signal on, so that the browser ends as Chrome would (its preferences
        # written), as OSWorld's checkers expect after their `pkill chrome`. Where the sandbox serves
        # the accessibility tree (a11y.py sets ACCESSIBILITY_ENABLED), web pages are in it from the
        # first reading (without the flag Chromium builds a page's tree only once asked, after).
        wrapper = bin_dir / "chrome"
        wrapper.unlink(missing_ok=True)
        wrapper.write_text(
            "#!/bin/sh\n# Chromium as OSWorld's Chrome (see desktop_sandbox/confinement.py)\n"
            # On OSWorld's VM (GNOME) Chrome's windows open maximized, beside the dock.
            'case "$XDG_CURRENT_DESKTOP" in *GNOME*) set -- --start-maximized "$@" ;; esac\n'
            f"{shlex.quote(chromium)} --no-sandbox --test-type --no-first-run --password-store=basic "
            '${ACCESSIBILITY_ENABLED:+--force-renderer-accessibility} '
            '--user-data-dir="$HOME/.config/google-chrome" "$@" &\n'
            "browser=$!\n"
            "trap 'kill -TERM $browser 2>/dev/null' TERM INT HUP\n"
            "wait $browser\n"
            "wait $browser\n")  # a trapped signal ends the first wait early: wait for the browser to finish
        wrapper.chmod(0o755)
        shim = bin_dir / "google-chrome"
        shim.write_text('#!/bin/sh\nexec "$(dirname "$0")/chrome" "$@"\n')
        shim.chmod(0o755)
    code = bin_dir / "code"
    code.unlink(missing_ok=True)
    if vscode:  # OSWorld's vs_code tasks run `code` by name, and the VM's dock has it
        code.write_text(f"#!/bin/sh\n# VS Code (code-server in an application window: docs/vscode.md)\n"
                        f"exec {shlex.quote(vscode)}/bin/code \"$@\"\n")
        code.chmod(0o755)
    _write_xdg_defaults(bin_dir / XDG_DIR, browser=chromium, vscode=vscode)
    return bin_dir


XDG_DIR = "xdg"
"""Under the shim directory: the desktop's default applications (`mimeapps.list`, read through
XDG_CONFIG_DIRS) and the `google-chrome.desktop` entry they name (through XDG_DATA_DIRS)."""
XDG_DEFAULTS = {
    "text/plain": "org.xfce.mousepad.desktop", "text/x-python": "org.xfce.mousepad.desktop",
    "text/x-csrc": "org.xfce.mousepad.desktop", "text/markdown": "org.xfce.mousepad.desktop",
    "application/x-shellscript": "org.xfce.mousepad.desktop", "application/json": "org.xfce.mousepad.desktop",
}
"""What `xdg-open` (and so /setup/open_file) opens where Debian's own defaults differ from OSWorld's
Ubuntu image: a text file in the text editor (the VM's gedit; here Mousepad), not LibreOffice
Writer; web pages, links and PDFs in `google-chrome` (the VM's default browser; Debian's entry
would start Chromium itself, without Chrome's profile path); videos in GNOME's Videos (Totem,
the VM's default video player) where it is installed, not VLC. Office files (LibreOffice) and
images (GIMP) keep Debian's defaults."""
TOTEM = Path("/usr/share/applications/org.gnome.Totem.desktop")
BROWSER_TYPES = ("text/html", "application/xhtml+xml", "x-scheme-handler/http", "x-scheme-handler/https",
                 "application/pdf")


def _write_xdg_defaults(xdg: Path, browser: str | None, vscode: str | None = None) -> None:
    defaults = dict(XDG_DEFAULTS)
    (xdg / "applications").mkdir(mode=0o755, parents=True, exist_ok=True)
    entry = xdg / "applications" / "code.desktop"  # the VM's name for it: the dock's favourite (gnome.FAVORITES)
    entry.unlink(missing_ok=True)
    if vscode:
        entry.write_text("[Desktop Entry]\nType=Application\nName=Visual Studio Code\nComment=Code Editing. Redefined.\n"
                         "GenericName=Text Editor\nExec=code %F\nTerminal=false\n"
                         f"Icon={vscode}/code-server/node_modules/code-server/src/browser/media/pwa-icon-512.png\n"
                         "StartupWMClass=Code\nCategories=TextEditor;Development;IDE;\n"
                         "MimeType=inode/directory;application/x-code-workspace;\nKeywords=vscode;\n")
    if TOTEM.is_file():  # every video type Totem takes: xdg-mime then answers as on the VM
        for line in TOTEM.read_text(errors="replace").splitlines():
            if line.startswith("MimeType="):
                defaults.update({kind: TOTEM.name for kind in line[9:].split(";") if kind.startswith("video/")})
    if browser:
        chromium = browser
        defaults.update({kind: "google-chrome.desktop" for kind in BROWSER_TYPES})
        (xdg / "applications" / "google-chrome.desktop").write_text(
            "[Desktop Entry]\nVersion=1.0\nType=Application\nName=Google Chrome\n"
            "Exec=google-chrome %U\nTerminal=false\n"  # the shim: the trusted directory leads PATH
            f"Icon={'google-chrome' if chromium.startswith('/opt/google') else 'chromium'}\n"
            f"StartupWMClass={'Google-chrome' if chromium.startswith('/opt/google') else 'Chromium-browser'}\n"
            f"MimeType={';'.join(BROWSER_TYPES)};\nCategories=Network;WebBrowser;\n")
    (xdg / "mimeapps.list").write_text(
        "# the sandbox's default applications (desktop_sandbox/confinement.py, XDG_DEFAULTS)\n"
        "[Default Applications]\n" + "".join(f"{kind}={entry}\n" for kind, entry in sorted(defaults.items())))


_SUDO_HEAD = r"""#!/bin/sh
# OSWorld's VM user may sudo with the password "password": typed at the terminal's prompt, or given
# on stdin with -S (`echo password | sudo -S <command>`, as task set-ups do). The sandbox has no
# privilege to give: this sudo checks the password the same way and runs the command as the
# sandbox's own user. What needs root for real (writing /etc) fails as it would for that user; apt
# answers from the host's package database (read-only): `apt-get update` has nothing to fetch, a
# package already installed is "already the newest version", any other cannot be installed.
password=""
from_stdin=0
never_ask=0
"""
_SUDO_OPTIONS = r"""while [ $# -gt 0 ]; do
  case "$1" in
    -S|--stdin) from_stdin=1; shift ;;
    -n|--non-interactive) never_ask=1; shift ;;
    -u|-g|-p|-C|-D|-h|-r|-t|-U|-T) shift 2 ;;
    -k|-K|-E|-H|-b|-i|-s|-l|-v|-A|-P|-V|--preserve-env*|--login|--reset-timestamp) shift ;;
    --) shift; break ;;
    -*) shift ;;
    *) break ;;
  esac
done
"""
_SUDO_PASSWORD = r"""stamp="${XDG_RUNTIME_DIR:-/tmp}/.sudo-$(id -u)-$(tty 2>/dev/null | tr -c 'a-z0-9\n' _)"
if [ "$from_stdin" = 1 ]; then
  printf '[sudo] password for %s: ' "$(id -un)" >&2
  IFS= read -r password || true
elif [ -n "$(find "$stamp" -mmin -15 2>/dev/null)" ]; then
  password=password  # asked less than 15 minutes ago on this terminal, as sudo remembers
elif [ "$never_ask" = 1 ]; then
  echo "sudo: a password is required" >&2; exit 1
elif ! { : </dev/tty; } 2>/dev/null; then
  echo "sudo: a terminal is required to read the password; either use the -S option to read from standard input or configure an askpass helper" >&2
  exit 1
else
  printf '[sudo] password for %s: ' "$(id -un)" >/dev/tty
  saved="$(stty -g </dev/tty 2>/dev/null)"
  stty -echo </dev/tty 2>/dev/null
  IFS= read -r password </dev/tty || true
  [ -n "$saved" ] && stty "$saved" </dev/tty 2>/dev/null
  echo >/dev/tty
fi
if [ "$password" != "password" ]; then
  echo "Sorry, try again." >&2
  echo "sudo: 1 incorrect password attempt" >&2
  exit 1
fi
[ "$from_stdin" = 1 ] || touch "$stamp" 2>/dev/null
"""
_SUDO_AS_USER = r"""[ $# -gt 0 ] || exit 0
case "$(basename -- "$1")" in
  apt|apt-get)
    tool="$1"; shift
    verb=""; packages=""
    for arg; do
      case "$arg" in -*) ;; *) if [ -z "$verb" ]; then verb="$arg"; else packages="$packages $arg"; fi ;; esac
    done
    case "$verb" in
      update)
        echo "Reading package lists... Done"
        echo "N: the sandbox's package lists are the host's, read-only: nothing to fetch (no network)" >&2
        exit 0 ;;
      install)
        missing=""
        echo "Reading package lists... Done"
        for pkg in $packages; do
          name="${pkg%%=*}"
          if dpkg-query -W -f='${Status}' "$name" 2>/dev/null | grep -q "install ok installed"; then
            echo "$name is already the newest version ($(dpkg-query -W -f='${Version}' "$name"))."
          else
            missing="$missing $name"
          fi
        done
        if [ -n "$missing" ]; then
          echo "E: Unable to locate package${missing} (the sandbox installs nothing: no network, no root)" >&2
          exit 100
        fi
        echo "0 upgraded, 0 newly installed, 0 to remove and 0 not upgraded."
        exit 0 ;;
    esac
    exec "$tool" "$@" ;;
esac
exec "$@"
"""
SUDO_SHIM = _SUDO_HEAD + _SUDO_OPTIONS + _SUDO_PASSWORD + _SUDO_AS_USER
"""`sudo` inside the sandbox (see its comment); OSWorld's set-ups rely on `sudo -S` existing."""

_SUDO_ROOT_HEAD = r"""#!/bin/sh
# OSWorld's VM user may sudo with the password "password": typed at the terminal's prompt, or given
# on stdin with -S (`echo password | sudo -S <command>`, as task set-ups do). Root inside this
# sandbox is real (env.options.sudo=root): this sudo checks the password the same way, then the
# sandbox's root broker runs the command as root (or as -u's user) on this terminal
# (desktop_sandbox/sudo.py). What it changes in the system lasts until the next reset.
password=""
from_stdin=0
never_ask=0
target=root
login=0
shell=0
keep_env=0
"""
_SUDO_ROOT_OPTIONS = r"""while [ $# -gt 0 ]; do
  case "$1" in
    -S|--stdin) from_stdin=1; shift ;;
    -n|--non-interactive) never_ask=1; shift ;;
    -u|--user) target="$2"; shift 2 ;;
    -u?*) target="${1#-u}"; shift ;;
    --user=*) target="${1#--user=}"; shift ;;
    -i|--login) login=1; shift ;;
    -s|--shell) shell=1; shift ;;
    -E|--preserve-env) keep_env=1; shift ;;
    -g|-p|-C|-D|-h|-r|-t|-U|-T) shift 2 ;;
    -k|-K|-H|-b|-l|-v|-A|-P|-V|--preserve-env=*|--reset-timestamp) shift ;;
    --) shift; break ;;
    -*) shift ;;
    *) break ;;
  esac
done
"""
_SUDO_AS_ROOT = r"""[ $# -gt 0 ] || [ "$login$shell" != 00 ] || exit 0
set -- -- "$@"
[ "$keep_env" = 0 ] || set -- --keep-env "$@"
[ "$shell" = 0 ] || set -- --shell "$@"
[ "$login" = 0 ] || set -- --login "$@"
exec 3<<EOF
$password
EOF
"""


def sudo_root_shim(client: str) -> str:
    """`sudo` with root inside: the same options and password as SUDO_SHIM, then `client` (a shell
    command line running sudo.py's client), which reads the password from descriptor 3."""
    return (_SUDO_ROOT_HEAD + _SUDO_ROOT_OPTIONS + _SUDO_PASSWORD + _SUDO_AS_ROOT
            + f'exec {client} --user "$target" "$@"\n')

CHROMIUM_BINARIES = ("/opt/google/chrome/chrome", "/usr/lib/chromium/chromium", "/usr/lib/chromium-browser/chromium-browser")
"""The browser binary itself (not Debian's /usr/bin/chromium wrapper script): Google Chrome's .deb
where installed (scripts/setup_desktop.sh installs it on Ubuntu, whose apt chromium is a snap stub),
else Debian's Chromium."""


def sandbox_environment(home: str = HOME_IN_SANDBOX) -> dict[str, str]:
    """The whole environment of the sandbox's processes: nothing of the host's (no tokens, no
    credentials, no paths)."""
    return {"HOME": home, "USER": "user", "LOGNAME": "user", "SHELL": "/bin/bash", "PATH": SANDBOX_PATH,
            "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


# ---- the seccomp filter ----------------------------------------------------------------------------

DENIED_SYSCALLS = (
    # namespaces and mounts: no nested sandbox, no changing what the sandbox sees
    "unshare", "setns", "mount", "umount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    # other processes' memory and descriptors (the action server's among them)
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    # the kernel's larger attack surface
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key", "init_module", "finit_module", "delete_module", "kexec_load",
    "kexec_file_load", "reboot", "swapon", "swapoff", "syslog", "acct", "quotactl", "quotactl_fd",
    "lookup_dcookie", "open_by_handle_at", "name_to_handle_at", "iopl", "ioperm", "uselib", "vhangup",
    "nfsservctl", "fanotify_init", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "personality",
)
"""Refused with EPERM inside the sandbox (Docker's default profile refuses much the same set)."""
NAMESPACE_CLONE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                         0x40000000, 0x00000080)
"""CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME: clone() with any is refused."""
TERMINAL_INJECTION_IOCTLS = (0x5412, 0x541C)
"""TIOCSTI (push characters into a terminal's input) and TIOCLINUX."""


def seccomp_filter_bpf(out: BinaryIO) -> list[str]:
    """Write the sandbox's seccomp program (classic BPF, what `bwrap --seccomp` loads) to `out`,
    built with libseccomp (through pyseccomp, or libseccomp's own `seccomp` module where installed).
    Returns the system calls this libseccomp does not know (left out)."""
    seccomp = _seccomp_module()
    denied = seccomp.ERRNO(1)  # EPERM
    rules = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    unknown = []
    for name in DENIED_SYSCALLS:
        try:
            rules.add_rule(denied, name)
        except (RuntimeError, OSError, ValueError):
            unknown.append(name)
    for flag in NAMESPACE_CLONE_FLAGS:
        rules.add_rule(denied, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    # clone3 passes its flags in memory a filter cannot read: refused as "not implemented", so the C
    # library falls back to clone(), whose flags the rules above see (what Docker and Flatpak do).
    rules.add_rule(seccomp.ERRNO(38), "clone3")
    for request in TERMINAL_INJECTION_IOCTLS:
        rules.add_rule(denied, "ioctl", seccomp.Arg(1, seccomp.MASKED_EQ, 0xFFFFFFFF, request))
    rules.export_bpf(out)
    return unknown


def _seccomp_module() -> Any:
    try:
        import seccomp  # libseccomp's own binding (Debian: python3-seccomp)
        return seccomp
    except ImportError:
        pass
    try:
        import pyseccomp
    except ImportError as e:
        raise RuntimeError("the desktop sandbox needs a libseccomp binding: pip install pyseccomp "
                           "(./workbench setup installs it)") from e
    except RuntimeError as e:  # pyseccomp raises this when libseccomp.so is missing
        raise RuntimeError(f"{e}: install libseccomp (Debian/Ubuntu: apt-get install libseccomp2)") from e
    return pyseccomp


# ---- cgroups: kernel limits for a sandbox whose user maps to root -------------------------------

DESKTOP_MEMORY_MIB = 768
"""What the desktop itself (server, X server, window manager) may use beyond the episode's limits."""
DESKTOP_PIDS = 64


class Cgroup:
    """A cgroup per sandbox with `pids.max` and a memory limit: what the kernel enforces where
    RLIMIT_NPROC does not (root is exempt from it, and a sandbox started by root whose Python only
    root can read runs as root on the host). Made where the caller may create cgroups (root with
    a writable cgroup v1 hierarchy per controller, or a cgroup v2 tree whose own cgroup can host
    children with the controllers on); `create` returns None elsewhere. Processes join through
    `join_command`; `remove` deletes the directories once the processes are gone."""

    ROOT = Path("/sys/fs/cgroup")

    def __init__(self, directories: dict[str, Path], kind: str) -> None:
        self.directories, self.kind = directories, kind

    @classmethod
    def create(cls, name: str, limits: Limits, system_layer: bool = False) -> "Cgroup | None":
        """`system_layer`: root inside, whose writable layer (`limits.system_mib`) is memory too."""
        if os.geteuid() != 0:
            return None
        memory = (limits.total_memory_mib + limits.home_mib + 4 * limits.scratch_mib + DESKTOP_MEMORY_MIB
                  + (limits.system_mib if system_layer else 0)) * 2**20
        pids = limits.pids + DESKTOP_PIDS
        own = _own_cgroups()
        made: dict[str, Path] = {}
        try:
            if (cls.ROOT / "cgroup.controllers").is_file():  # cgroup v2 mounted at /sys/fs/cgroup
                directory = cls.ROOT / own.get("", "/").lstrip("/") / name
                directory.mkdir()
                made["unified"] = directory
                (directory / "pids.max").write_text(f"{pids}\n")
                (directory / "memory.max").write_text(f"{memory}\n")
                return cls(made, "v2")
            for controller, limit_file, value in (("pids", "pids.max", pids), ("memory", "memory.limit_in_bytes", memory)):
                hierarchy = cls.ROOT / controller
                if not (hierarchy / "cgroup.procs").is_file():
                    raise OSError(f"no cgroup v1 {controller} hierarchy")
                directory = hierarchy / own.get(controller, "/").lstrip("/") / name
                directory.mkdir()
                made[controller] = directory
                (directory / limit_file).write_text(f"{value}\n")
            return cls(made, "v1")
        except OSError:
            cls(made, "").remove(wait_s=0)
            return None

    def join_command(self, command: list[str]) -> list[str]:
        """`command`, started by a shell that first moves itself into this cgroup (so the very first
        process of the sandbox, and everything after it, is counted)."""
        files = [str(d / "cgroup.procs") for d in self.directories.values()]
        script = ('n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 97; shift; n=$((n-1)); done; '
                  'exec "$@"')
        return ["/bin/sh", "-c", script, "sh", str(len(files)), *files, *command]

    def add(self, pid: int) -> None:
        """Move process `pid` into this cgroup (its children to come are counted with it)."""
        for directory in self.directories.values():
            (directory / "cgroup.procs").write_text(f"{pid}\n")

    def remove(self, wait_s: float = 10.0) -> bool:
        """Delete the cgroup directories (the kernel refuses while a process is in them: retried
        for `wait_s`). Whether all are gone."""
        import time

        deadline = time.monotonic() + wait_s
        while True:
            left = []
            for directory in self.directories.values():
                try:
                    directory.rmdir()
                except FileNotFoundError:
                    pass
                except OSError:
                    left.append(directory)
            if not left or time.monotonic() >= deadline:
                return not left
            time.sleep(0.1)


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per controller ("" for cgroup v2), from /proc/self/cgroup."""
    paths: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths
