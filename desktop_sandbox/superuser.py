"""Real root inside the sandbox, as an option: `Sandbox(sudo="root")` (`env.options.sudo: root`).

OSWorld's VM lets its user run `sudo` with the password `password` and get root: install packages,
change the system's configuration. By default the sandbox's `sudo` checks that password and gives
no privilege (confinement.SUDO_SHIM). With `sudo="root"` it gives root for real, inside the sandbox
only, over a writable layer of the system directories that no reset keeps. How (the host is root):

- One user namespace maps the sandbox's ids 0..65534 to a block of unprivileged host uids of its
  own (sandbox.py claims it): root inside is one of them, `user` (1000) another, the system
  accounts the rest. bubblewrap creates the namespace and waits (`--userns-block-fd`) while the
  host writes that map: bubblewrap alone maps one id.
- In it, an outer bubblewrap (its own PID and network namespaces, seeing only what the sandbox
  will see) runs fuse-overlayfs as root inside, that is as the block's first, unprivileged, host
  uid: one overlay whose lower layer is the host's system trees the sandbox may see (`LOWER_TREES`,
  read-only; read as that uid, so a host file no other user may read stays unreadable, to root
  inside too) and whose upper layer is a sized tmpfs (`Limits.system_mib`). The upper starts from
  a seed the host writes (`write_seed`): the sandbox's own accounts, hostname and machine-id, and
  an empty file or directory in place of every secret of /etc and every entry that uid cannot read.
- The sandbox itself is a second bubblewrap run there as root inside, with the overlay as its `/`
  (confinement.bwrap_arguments, `system_root`): its first process starts a broker that stays root
  and becomes the action server as `user` (sudo.py); `sudo` asks the broker, which runs the
  command as root on the caller's terminal.

What root inside cannot do: anything needing a capability over the host (it is a user namespace's
root); trace or read other processes (CAP_SYS_PTRACE is gone from every process of the sandbox, so
the undumpable action server and broker stay out of reach); change the network (CAP_NET_ADMIN is
gone: the user-mode network's fence holds); mount, create namespaces, load modules (the sandbox's
seccomp filter); gain anything through set-uid or file-capability programs (no_new_privs); see the
overlay's daemon, the outer namespace or the host's processes (PID namespaces). Nothing it writes
reaches the host's disk (the upper layer is a tmpfs of the outer namespace, gone with it).

The broker reports every grant before the command runs, on a pipe only the host reads (`Grants`);
a reset after an episode in which root was granted starts the sandbox anew, from a fresh layer.
"""
from __future__ import annotations

import functools
import json
import os
import select
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

from desktop_sandbox import confinement

SUDO_MODES = ("user", "root")
"""`user`: sudo checks the password and runs the command as the sandbox's user (the default);
`root`: sudo gives root inside the sandbox (this module)."""
ID_COUNT = 65535
"""Ids 0..65534 inside are mapped (uids and gids alike): root, the system accounts, `user`, nobody."""
LOWER_TREES = ("/usr", "/etc", "/opt/google", "/var/lib/dpkg", "/var/lib/apt", "/var/cache/fontconfig")
"""Host trees under the overlay (those that exist): what the sandbox sees of the host's system
without root inside (confinement.SYSTEM_TREES, READ_ONLY_EXTRAS), and apt's state beside dpkg's.
apt's download cache and debconf's database are not the host's: they start empty."""
WALKED_TREES = ("/etc", "/opt/google", "/var/lib/dpkg", "/var/lib/apt", "/var/cache/fontconfig")
"""Where the seed hides what an unprivileged uid cannot read (walked at every start, a few ms;
/usr is too large to walk: there such an entry answers "Permission denied", to root inside too)."""
SEED_DIRS = {"root": 0o700, "home": 0o755, "var/log/apt": 0o755, "var/cache/apt/archives/partial": 0o700,
             "var/cache/debconf": 0o755, "var/lib/apt/lists/partial": 0o700, "var/lib/dpkg/triggers": 0o755}
"""Directories the seed makes (mode): root's home, and what apt and dpkg expect to find."""
SEED_LOCKS = ("var/lib/dpkg/lock", "var/lib/dpkg/lock-frontend", "var/lib/dpkg/triggers/Lock",
              "var/lib/apt/lists/lock", "var/cache/apt/archives/lock")
"""dpkg's and apt's lock files: the host's are root's alone (0640), so the seed gives fresh ones."""
ROOT_PASSWORD_HASH = "$6$arposandbox$UjiPLhdJywruA49G3PnFaK2.ycvER1jgp2Fu9i0zgRRQGymlMZ25xW3vlnUR8Op9epfhBdI5NgAhxHRApZLj81"
"""`user`'s password in the sandbox's /etc/shadow: "password", as on OSWorld's VM (SHA-512 crypt)."""

OUTER_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
LOWER = "/lower"
SEED = "/seed"
LAYERS = "/layers"
SYSTEM_ROOT = f"{LAYERS}/merged"
"""In the outer namespace: the lower layer's tree, the host-written seed, the tmpfs holding the
overlay's upper and work directories, and the overlay itself (the sandbox's `/`)."""
OVERFLOW_ID = 65534
ID_MAPPING = f"{OVERFLOW_ID}:0:1:0:0:{OVERFLOW_ID}"
"""fuse-overlayfs's id mapping (host-view:inside:count, the last triple wins for ids it covers):
ids 0..65533 as they are, and the overflow id, which every host id outside the map reads as (the
host's root among them), shown as root. A directory copied up keeps the overflow id on disk (the
map includes 65534 for that) and is still shown as root's."""
MOUNT_WAIT_S = 10.0
FUSE_OPTIONS = "threaded=1,noxattrs=1,fsync=0"
"""Several threads; no extended attributes (with no_new_privs file capabilities do nothing, and
GNOME's start asks for them file by file); no fsync (the upper layer is a tmpfs). Not fast_ino:
with it, fuse-overlayfs 1.10 confused files here (after an `apt-get install`, dpkg's lock was a
directory and /bin/sh could no longer be run)."""

LAYER_SCRIPT = r"""set -eu
mkdir {layers}/upper {layers}/work {layers}/merged
cp -a {seed}/. {layers}/upper/
setpriv --pdeathsig KILL fuse-overlayfs -f \
  -o lowerdir={lower},upperdir={layers}/upper,workdir={layers}/work,{options},uidmapping={mapping},gidmapping={mapping} \
  {merged} &
i=0
until [ "$(stat -c %d {merged})" != "$(stat -c %d {layers})" ]; do
  kill -0 $! 2>/dev/null || {{ echo "the system layer (fuse-overlayfs) did not start" >&2; exit 1; }}
  i=$((i + 1)); [ $i -lt {tries} ] || {{ echo "the system layer (fuse-overlayfs) did not mount" >&2; exit 1; }}
  sleep 0.02
done
exec bwrap "$@"
"""
"""The outer namespace's one process, as root inside: the overlay (its daemon ends with this
process: after the exec, with the sandbox's bubblewrap), then the sandbox. Arguments: the inner
bubblewrap's (`--args FD`, then the command)."""


def sudo_mode(value: str | None) -> str:
    """"user" or "root" from the option (None: "user")."""
    if value is None:
        return "user"
    if value not in SUDO_MODES:
        raise ValueError(f"sudo must be one of {SUDO_MODES}, got {value!r}")
    return value


# ---- what this machine offers ----------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def unavailable() -> str | None:
    """Why root inside cannot be offered here, or None. Asked once per process: after the tools,
    a probe starts the real mechanism (the mapped namespace, the overlay, a write as root inside)."""
    if os.geteuid() != 0:
        return ("env.options.sudo=root needs root on the host: the host maps the sandbox's 65535 ids (root and "
                "`user` among them) to unprivileged uids of their own, which an ordinary user cannot (bubblewrap "
                "maps one id)")
    for tool, package in (("bwrap", "bubblewrap"), ("fuse-overlayfs", "fuse-overlayfs"), ("setpriv", "util-linux")):
        if not shutil.which(tool):
            return f"env.options.sudo=root needs {tool} (Debian package {package}; ./workbench setup installs it)"
    if "--size" not in confinement.bwrap_features():
        return "env.options.sudo=root needs bubblewrap >= 0.7 (--size: the system layer is a sized tmpfs)"
    try:
        if not stat.S_ISCHR(os.stat("/dev/fuse").st_mode):
            raise OSError("not a character device")
    except OSError as e:
        return f"env.options.sudo=root needs /dev/fuse (the system layer is a FUSE file system): {e}"
    refused = confinement.user_namespaces_refused()
    if refused is not None:
        return f"env.options.sudo=root needs user namespaces, which are refused here: {refused}"
    return probe()


def probe() -> str | None:
    """Start the mechanism once with a shell for the sandbox: the map, the overlay over the host's
    /usr, and a file written there as root inside; None when all of it worked, else why not."""
    from desktop_sandbox.sandbox import claim_id_block  # the uid locks live there

    base, lock = claim_id_block()
    seed = Path(tempfile.mkdtemp(prefix="arpo-sudo-probe-"))
    try:
        seed.chmod(0o755)
        os.chown(seed, base, base)
        inner = ["--bind", SYSTEM_ROOT, "/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--unshare-pid",
                 "--die-with-parent", "--cap-drop", "ALL", "--cap-add", "CAP_DAC_OVERRIDE", "--",
                 "/bin/sh", "-c", "touch /usr/.arpo-probe && stat -c %u /usr/.arpo-probe"]
        start = OuterStart(base, outer_arguments(seed, layer_mib=8, share_network=False, binds=[], lower=("/usr",)),
                           inner_arguments_fd=None)
        process = subprocess.Popen(start.command(inner), pass_fds=start.pass_fds, user=base, group=base,
                                   extra_groups=[], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        try:
            start.map_ids(start.namespace_pid(process))
            out, err = process.communicate(timeout=30)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            process.kill()
            process.communicate()
            return f"env.options.sudo=root cannot start here: {e}"
        finally:
            start.close()
        if process.returncode != 0 or out.strip() != "0":
            errors = " ".join(line for line in err.splitlines() if "lazytime" not in line)
            return f"env.options.sudo=root cannot start here (exit {process.returncode}): {errors[-400:] or out[-200:]}"
        return None
    finally:
        shutil.rmtree(seed, ignore_errors=True)
        os.close(lock)


# ---- the seed of the upper layer ------------------------------------------------------------------

def write_seed(seed: Path, owner: int, resolv_conf: str | None = None) -> None:
    """The upper layer's starting content, in `seed` (copied into the tmpfs at every start): the
    sandbox's passwd, group, shadow and gshadow (the host's system accounts, below uid 1000, which
    dpkg's state names, then `user` with the VM's password), hostname, hosts, machine-id and
    resolv.conf; an empty file or directory (opaque: nothing of the host's shows through it) for
    every secret of /etc and every entry of `WALKED_TREES` an unprivileged uid cannot read; the
    directories and lock files apt and dpkg expect. Owned by `owner`, the host uid of root inside."""
    etc = seed / "etc"
    etc.mkdir(parents=True)
    masks = dict((path, kind) for kind, path in confinement.etc_masks())
    for tree in WALKED_TREES[1:]:
        if os.path.isdir(tree):
            masks.update((path, kind) for kind, path in confinement.unreadable_for_others(tree))
    for path, kind in masks.items():  # readable and empty, as the sandbox without root shows them
        target = seed / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if kind == "dir":
            target.mkdir(exist_ok=True)
            (target / ".wh..wh..opq").touch()  # fuse-overlayfs's mark of an opaque directory
        else:
            target.touch()
        target.chmod(0o755 if kind == "dir" else 0o644)
    confinement.write_identity_files(etc)
    _write_accounts(etc)
    for name, mode in (("passwd", 0o644), ("group", 0o644), ("hostname", 0o644), ("hosts", 0o644),
                       ("machine-id", 0o444), ("shadow", 0o640), ("gshadow", 0o640)):
        (etc / name).chmod(mode)
    if resolv_conf is not None:
        (etc / "resolv.conf").write_text(resolv_conf)
        (etc / "resolv.conf").chmod(0o644)
    for name, mode in SEED_DIRS.items():
        (seed / name).mkdir(mode=mode, parents=True, exist_ok=True)
        (seed / name).chmod(mode)
    for name in SEED_LOCKS:
        (seed / name).touch()
        (seed / name).chmod(0o640)
    # A directory in the upper layer gives the merged one its mode: the parents made on the way
    # (/etc/ssl for a mask of /etc/ssl/private) keep the host's, whatever this process's umask.
    made = {seed / path.lstrip("/") for path, kind in masks.items() if kind == "dir"} | {seed / n for n in SEED_DIRS}
    for directory in [seed, *(d for d in seed.rglob("*") if d.is_dir() and not d.is_symlink())]:
        if directory not in made:
            host = "/" + str(directory.relative_to(seed)).removeprefix(".")
            directory.chmod(stat.S_IMODE(os.stat(host).st_mode) if os.path.isdir(host) else 0o755)
    for path in [seed, *seed.rglob("*")]:
        os.lchown(path, owner, owner)


def _write_accounts(etc: Path) -> None:
    """passwd, group, shadow and gshadow: root, the host's system accounts and groups (ids below
    1000, and nobody: dpkg refuses to run when its state names an account it cannot find), `user`."""
    uid = confinement.USER_ID
    ours = ("root", "user")
    system_users = [line for line in _host_lines("/etc/passwd") if _system_id(line, 2) and line.split(":")[0] not in ours]
    system_groups = [line for line in _host_lines("/etc/group") if _system_id(line, 2) and line.split(":")[0] not in ours]
    users = ["root:x:0:0:root:/root:/bin/bash", *system_users,
             f"user:x:{uid}:{uid}:Desktop user:{confinement.HOME_IN_SANDBOX}:/bin/bash"]
    groups = ["root:x:0:", *(_without_members(g) for g in system_groups), f"user:x:{uid}:"]
    (etc / "passwd").write_text("".join(f"{u}\n" for u in _unique(users)))
    (etc / "group").write_text("".join(f"{g}\n" for g in _unique(groups)))
    (etc / "shadow").write_text("".join(
        f"{u.split(':')[0]}:{ROOT_PASSWORD_HASH if u.startswith('user:') else '*'}:19000:0:99999:7:::\n"
        for u in _unique(users)))
    (etc / "gshadow").write_text("".join(f"{g.split(':')[0]}:*::\n" for g in _unique(groups)))


def _host_lines(path: str) -> list[str]:
    try:
        return [line for line in Path(path).read_text(errors="replace").splitlines() if line.count(":") >= 3]
    except OSError:
        return []


def _system_id(line: str, field: int) -> bool:
    try:
        value = int(line.split(":")[field])
    except ValueError:
        return False
    return value < 1000 or value == OVERFLOW_ID


def _without_members(group_line: str) -> str:
    """A host group without its members (they name the host's own users)."""
    return ":".join(group_line.split(":")[:3]) + ":"


def _unique(lines: list[str]) -> list[str]:
    """The first entry of each name."""
    first: dict[str, str] = {}
    for line in lines:
        first.setdefault(line.split(":")[0], line)
    return list(first.values())


# ---- the outer namespace ----------------------------------------------------------------------------

def outer_arguments(seed: Path, *, layer_mib: int, share_network: bool, binds: list[str],
                    lower: tuple[str, ...] = LOWER_TREES) -> list[str]:
    """bubblewrap's options for the outer namespace (before `--args`' owner adds the command): a
    user namespace whose map the host writes, its own PID (and, unless `share_network`, network)
    namespace, and a view of the host holding only what the overlay and the sandbox's bubblewrap
    read: the system (to run them), the lower trees, the seed, the sandbox's own binds (`binds`, at
    their paths), /dev/fuse, and a sized tmpfs for the layers."""
    args = ["--unshare-user", "--uid", "0", "--gid", "0", "--cap-add", "ALL", "--unshare-pid", "--unshare-ipc",
            "--die-with-parent", "--clearenv", "--setenv", "PATH", OUTER_PATH]
    if not share_network:
        args.append("--unshare-net")
    args += ["--ro-bind", "/usr", "/usr"]
    for name in confinement.ROOT_LINKS:
        path = f"/{name}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path, "--symlink", os.readlink(path), f"{LOWER}{path}"]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path, "--ro-bind", path, f"{LOWER}{path}"]
    if os.path.exists("/etc/ld.so.cache"):
        args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    trees = [f"{LOWER}{tree}" for tree in lower if os.path.isdir(tree)]
    args += confinement.world_readable_parents(trees)  # the sandbox's /var, /opt
    for tree in lower:
        if os.path.isdir(tree):
            args += ["--ro-bind", tree, f"{LOWER}{tree}"]
    args += ["--ro-bind", str(seed), SEED, "--size", str(layer_mib * 2**20), "--tmpfs", LAYERS, "--dir", "/tmp",
             "--dev", "/dev", "--dev-bind", "/dev/fuse", "/dev/fuse", "--proc", "/proc"]
    for path in dict.fromkeys(binds):
        args += ["--ro-bind", path, path]
    return args


class OuterStart:
    """Starting the outer namespace: the pipes bubblewrap reports its child on and waits on, the
    options file, and the map written once the namespace exists (`map_ids`)."""

    def __init__(self, first_id: int, arguments: list[str], inner_arguments_fd: int | None) -> None:
        self.first_id = first_id
        self._info_read, self._info_write = os.pipe()
        self._block_read, self._block_write = os.pipe()
        for fd in (self._info_read, self._block_write):
            os.set_inheritable(fd, False)
        args = [*arguments, "--userns-block-fd", str(self._block_read), "--info-fd", str(self._info_write)]
        self._args_read, args_write = os.pipe()
        data = b"".join(a.encode() + b"\0" for a in args)
        if len(data) > 60000:  # a pipe holds 64 KiB: more would block this write
            raise RuntimeError(f"the outer namespace's options are too long ({len(data)} bytes)")
        os.write(args_write, data)
        os.close(args_write)
        self.inner_arguments_fd = inner_arguments_fd
        self.pass_fds = (self._info_write, self._block_read, self._args_read)

    def command(self, inner: list[str]) -> list[str]:
        """The outer bubblewrap, its one process (LAYER_SCRIPT) and, after `inner`'s bubblewrap
        options (or `--args FD` naming a file of them), the sandbox's command."""
        script = LAYER_SCRIPT.format(options=FUSE_OPTIONS, layers=LAYERS, seed=SEED, lower=LOWER,
                                     mapping=ID_MAPPING, merged=SYSTEM_ROOT, tries=int(MOUNT_WAIT_S / 0.02))
        head = ["--args", str(self.inner_arguments_fd)] if self.inner_arguments_fd is not None else []
        return [shutil.which("bwrap") or "bwrap", "--args", str(self._args_read), "/bin/sh", "-c", script, "sh",
                *head, *inner]

    def namespace_pid(self, process: subprocess.Popen, timeout: float = 30.0) -> int:
        """The first process in bubblewrap's new namespaces (it waits there until `map_ids`).
        RuntimeError when bubblewrap did not get that far."""
        os.close(self._info_write)
        self._info_write = -1
        data = b""
        deadline = time.monotonic() + timeout
        while not data.rstrip().endswith(b"}"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._info_read], [], [], left)[0]:
                raise RuntimeError("bubblewrap did not report its namespace in time")
            chunk = os.read(self._info_read, 4096)
            if not chunk:
                raise RuntimeError(f"bubblewrap exited before its namespace was made (exit {process.poll()})")
            data += chunk
        return int(json.loads(data)["child-pid"])

    def map_ids(self, pid: int) -> None:
        """Map ids 0..ID_COUNT-1 inside the namespace of `pid` to this block of host uids (and gids),
        then let bubblewrap go on."""
        line = f"0 {self.first_id} {ID_COUNT}\n"
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(line)
        os.write(self._block_write, b"1")

    def close(self) -> None:
        for fd in (self._info_read, self._info_write, self._block_read, self._block_write, self._args_read):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._info_read = self._info_write = self._block_read = self._block_write = self._args_read = -1


# ---- what the host learns of the sandbox's root ------------------------------------------------------

class Grants:
    """The pipe the broker writes one byte to before every command it runs as root (sudo.py); only
    the host holds its read end. `granted()`: whether root was given since this sandbox started."""

    def __init__(self) -> None:
        self._read, self.write_fd = os.pipe()
        os.set_blocking(self._read, False)
        os.set_inheritable(self._read, False)
        self._granted = False

    def granted(self) -> bool:
        try:
            while os.read(self._read, 4096):
                self._granted = True
        except BlockingIOError:
            pass
        return self._granted

    def close_write_end(self) -> None:
        """After the sandbox started: the broker holds the only write end."""
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1

    def close(self) -> None:
        self.close_write_end()
        if self._read >= 0:
            os.close(self._read)
            self._read = -1
