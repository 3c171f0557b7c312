"""A private desktop for a hostile agent: its own X server, window manager and applications, no
network, a fresh home directory per episode, every process ended at each reset and on close.

    with Sandbox(screen=(1920, 1080)) as box:
        box.launch(["mousepad"])
        png = box.screenshot()
        box.run_action("import pyautogui\\npyautogui.click(100, 200)")

What confines it is computed in confinement.py (mounts, environment, seccomp, limits, the
isolation mode); what runs inside is server.py. In the `namespaces` mode the sandbox is one
`bwrap` process running as its own user (`user`, uid 1000, its own passwd) in new user, PID,
network, IPC and UTS namespaces, seeing read-only only the host's system trees and the Python
it needs, with size-capped tmpfs for its home and scratch directories, a seccomp filter and no
nested namespaces; `--die-with-parent` and the PID namespace end everything in it when it ends.
The action server inside listens on a socket the host creates in a private directory and hands
over as a file descriptor: no sandboxed program can reach it. In the `user` fallback the server
runs on the host and the agent's programs as a dedicated uid (confinement.USER_MODE_LOSSES).

The host keeps a private work directory per sandbox (the socket, the sandbox's identity files);
a watcher process removes it, and in user mode ends the agent's processes, when this process
closes the sandbox or dies, even by SIGKILL. The sandbox's output goes to a pipe whose tail the
host keeps in memory: no host file is held open inside.
"""
from __future__ import annotations

import fcntl
import functools
import grp
import http.client
import json
import logging
import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from desktop_sandbox import a11y, confinement, gnome, runtime, superuser, usernet
from desktop_sandbox.confinement import HOME_IN_SANDBOX, Limits
from desktop_sandbox.processes import ACTION_TIMEOUT_S

log = logging.getLogger(__name__)

class SandboxError(RuntimeError):
    """The sandbox cannot start, or its server stopped answering (the desktop failed, not the agent):
    a user of the sandbox treats it as an infrastructure failure (arpo_lib: EnvError)."""


DESKTOP_TOOLS = ("bwrap", "Xvfb", "openbox", "xdotool")
"""Commands the sandbox needs (Debian packages bubblewrap, xvfb, openbox, xdotool)."""
START_TIMEOUT_S = 60.0
AGENT_UIDS = range(61000, 62000)
"""User mode: where new agent accounts' uids are taken from (one account per concurrent sandbox)."""
UID_LOCKS = Path("/run/arpo-desktop-uids")
_BOOT = ("import sys; sys.path[:0] = {paths!r}; from desktop_sandbox.server import main; "
         "sys.exit(main(sys.argv[1:]))")
"""How the server starts: an isolated interpreter (-I: no environment variables, no user site, no
current directory on sys.path) that imports this package from the one directory given, and finds its
packages in the host's site directories (those PYTHONPATH added included)."""
_SUDO_BOOT = ("import sys; sys.path[:0] = {paths!r}; from desktop_sandbox.sudo import main; "
              "sys.exit(main(sys.argv[1:]))")
"""With root inside: how sudo.py starts (its init, and the client `sudo` runs), the same way."""
ID_BLOCKS = range(0x40000000, 0x7FFF0000, 0x10000)
"""With root inside: where the block of host uids a sandbox's ids map to is taken from (one per sandbox)."""


@functools.lru_cache(maxsize=None)
def desktop_unavailable(isolation: str = "auto") -> str | None:
    """Why no sandbox can start here (a missing tool, no isolation mode, no Pillow X grab, no
    libseccomp), or None. Checked once per process (every sandbox start asks)."""
    for tool in DESKTOP_TOOLS:
        if not shutil.which(tool):
            return (f"{tool} is not installed: the desktop environments need Debian's bubblewrap, xvfb, "
                    "openbox and xdotool (./workbench setup installs them)")
    try:
        from PIL import features
        if not features.check("xcb"):
            return "Pillow was built without XCB: it cannot take screenshots of the X server"
    except ImportError:
        return "Pillow is not installed"
    try:
        mode = confinement.choose_isolation(isolation)
        if mode == "namespaces":
            confinement._seccomp_module()
    except (RuntimeError, ValueError) as e:
        return str(e)
    return None


NETWORK_MODES = ("none", "user", "host")


def network_mode(network: bool | str | None) -> str:
    """"none", "user" or "host" from the option (False/None: none; True: host, as before)."""
    if network is None or network is False:
        return "none"
    if network is True:
        return "host"
    if network not in NETWORK_MODES:
        raise ValueError(f"network must be one of {NETWORK_MODES} (or a bool), got {network!r}")
    return network


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("sandbox", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


class Sandbox:
    """One private desktop. Raises SandboxError when it cannot start or its server stops answering.

    `limits`: confinement.Limits (or a mapping of its fields); `isolation`: "auto", "namespaces"
    or "user" (the dedicated-user fallback, root only); `network`: "none" (False: loopback only,
    the default), "user" (a user-mode network reaching outside addresses, never the host's
    loopback, its own addresses, link-local or metadata ones: usernet.py) or "host" (True: the
    host's network namespace, its loopback services included; no task needs it). `network` off:
    loopback only; on, the agent reaches the host's loopback services too). `sudo`: "user" (the
    default: sudo checks OSWorld's password and gives no privilege) or "root" (sudo gives root
    inside, over a writable layer of the system directories that a reset after its use throws
    away: superuser.py; needs root on the host)."""

    def __init__(self, screen: tuple[int, int] = (1920, 1080), *, network: bool | str = False,
                 window_manager: str = "openbox", binds: dict[str, str] | None = None,
                 limits: Limits | dict[str, Any] | None = None, isolation: str = "auto", sudo: str = "user") -> None:
        self.network = network_mode(network)
        self.sudo = superuser.sudo_mode(sudo)
        reason = desktop_unavailable(isolation)
        if reason is None and self.network == "user":
            reason = usernet.unavailable()
            if reason is None and confinement.choose_isolation(isolation) != "namespaces":
                reason = "env.options.network=user needs the namespaces isolation (bubblewrap)"
        if reason is None and window_manager == "gnome":
            reason = gnome.unavailable()
            if reason is None and confinement.choose_isolation(isolation) != "namespaces":
                reason = ("the GNOME desktop needs the namespaces isolation (bubblewrap with user namespaces); "
                          "the 'user' fallback runs the openbox desktop (env.options.desktop=openbox)")
        if reason is None and self.sudo == "root":
            if confinement.choose_isolation(isolation) != "namespaces":
                reason = "env.options.sudo=root needs the namespaces isolation (bubblewrap with user namespaces)"
            else:
                reason = superuser.unavailable()
        if reason:
            raise SandboxError(reason)
        self.window_manager = window_manager
        self.screen = screen
        self.limits = Limits.from_options(limits)
        self.isolation = confinement.choose_isolation(isolation)
        self.network_blocked = self.network == "none"
        self.usernet: usernet.UserNetwork | None = None
        self.agent_uid: int | None = None
        self.cgroup: confinement.Cgroup | None = None
        """The sandbox's cgroup (pids and memory limits enforced by the kernel), where one could be made."""
        self.host_uid: int | None = None
        """namespaces mode started by root: the unprivileged host uid the sandbox's user maps to
        (None: the caller's own uid)."""
        self._agent_gid: int | None = None
        self._uid_lock: int | None = None
        self._home_lock: int | None = None
        self.id_block: int | None = None
        """With root inside: the first of the host uids the sandbox's ids 0..65534 map to (root's)."""
        self.grants: superuser.Grants | None = None
        """With root inside: whether root was granted since the sandbox's process started."""
        self._outer: superuser.OuterStart | None = None
        self._binds = binds
        self._watcher: subprocess.Popen | None = None
        self._watcher_told = False
        self._output: _OutputTail | None = None
        """The end of the sandbox's output (its server's and bubblewrap's), kept in memory: what
        start-up errors quote."""
        self.workdir = Path(tempfile.mkdtemp(prefix="arpo-desktop-"))
        control = self.workdir / "control"  # the socket, the seccomp filter, the options: the host's only
        control.mkdir(mode=0o700)
        self.socket_path = str(control / "server.sock")
        self._launch()
        _say_once(self.describe())

    def _launch(self) -> None:
        """Start the sandbox's process and wait for its server: at construction, and with root
        inside at a reset after root was granted (the same work directory and socket path, so that
        whoever holds the path, OSWorld's bridge, keeps reaching it). SandboxError when it fails."""
        network = self.network == "host"  # bubblewrap shares the host's namespace only then
        Path(self.socket_path).unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.socket_path)
        listener.listen(64)
        self._fds_to_close: list[int] = []
        try:
            if self.isolation == "namespaces":
                command, pass_fds, env, cwd = self._namespaces_command(listener.fileno(), network, self.window_manager,
                                                                       self._binds)
            else:
                command, pass_fds, env, cwd = self._user_command(listener.fileno(), network, self.window_manager)
            identity = {} if self.host_uid is None else {"user": self.host_uid, "group": self.host_uid, "extra_groups": []}
            if self.sudo == "root":
                identity = {"user": self.id_block, "group": self.id_block, "extra_groups": []}
            # root is exempt from RLIMIT_NPROC (the kernel's other limit: a cgroup); with root inside,
            # what root inside writes to the system layer is memory the cgroup counts
            if self.cgroup is None and os.geteuid() == 0 and (self.host_uid is None or self.sudo == "root"):
                self.cgroup = confinement.Cgroup.create(self.workdir.name, self.limits, system_layer=self.sudo == "root")
            if self.cgroup is not None and self.sudo != "root":
                command = self.cgroup.join_command(command)
            if self._watcher is None:
                self._watcher = self._start_watcher(self._agent_gid)
            # PID 1 inside holds the sandbox's output: a program of the sandbox that may open its
            # /proc/1/fd/1 (the sandbox's user where it maps to the host's root; root inside) would
            # write into a host file held there. It goes into a pipe whose end the host keeps in memory.
            self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            pass_fds=pass_fds, env=env, cwd=cwd, **identity)
            self._output = _OutputTail(self.process.stdout)
            if self._outer is not None:
                self._map_root_namespace()
        except BaseException:
            listener.close()
            if getattr(self, "process", None) is not None and self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self._cleanup_files()
            raise
        finally:
            for fd in self._fds_to_close:
                os.close(fd)
            self._fds_to_close = []
            if self._outer is not None:
                self._outer.close()
                self._outer = None
            if self.grants is not None:
                self.grants.close_write_end()
        listener.close()  # the server holds it now
        if self.network == "user":
            try:
                self.usernet = usernet.UserNetwork(usernet.sandbox_init_pid(self.process.pid), self.workdir / "control")
                self.usernet.start()
            except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                self.close()
                raise SandboxError(f"the sandbox's user-mode network did not start: {e}") from e
        self._wait_ready()

    def _map_root_namespace(self) -> None:
        """With root inside: once bubblewrap made the user namespace (and waits), its processes
        join the sandbox's cgroup and the host writes the namespace's id map."""
        assert self._outer is not None
        try:
            child = self._outer.namespace_pid(self.process)
            if self.cgroup is not None:
                for pid in (self.process.pid, child):
                    self.cgroup.add(pid)
            self._outer.map_ids(child)
        except (RuntimeError, OSError) as e:
            raise SandboxError(f"the sandbox's root namespace could not be made: {e}: {self._log_tail()}") from e

    # -- starting ------------------------------------------------------------------------------
    def _server_arguments(self, listen_fd: int, window_manager: str, python: str | None = None,
                          sites: list[str] | None = None, package_parent: str | None = None) -> list[str]:
        """The server's command: by default this interpreter with the host's site directories and
        this package where it is (the user mode); the namespaces mode names the sandbox's own."""
        sites = confinement.site_directories() if sites is None else sites
        boot = _BOOT.format(paths=[package_parent or str(Path(confinement.package_dir()).parent), *sites])
        return [python or sys.executable, "-I", "-c", boot, "--python-path", json.dumps(sites), "--listen-fd", str(listen_fd), "--screen", f"{self.screen[0]}x{self.screen[1]}",
                "--wm", window_manager, "--limits", json.dumps(self.limits.as_dict()),
                "--host-pid-namespace", os.readlink("/proc/self/ns/pid"), "--a11y-missing", a11y.unavailable() or ""]

    def _namespaces_command(self, listen_fd: int, network: bool, window_manager: str,
                            binds: dict[str, str] | None) -> tuple[list[str], tuple[int, ...], dict[str, str], str]:
        as_root = self.sudo == "root"
        confinement.write_identity_files(self.workdir)
        try:
            python = runtime.stage(tuple(confinement.site_directories()))
        except (RuntimeError, OSError) as e:
            raise SandboxError(f"cannot stage the sandbox's Python: {e}") from e
        python_env = dict(python.environment)
        shutil.rmtree(self.workdir / "lib", ignore_errors=True)  # a launch after the first copies it anew
        runtime_binds = {**dict(python.binds),
                         str(runtime.copy_package(confinement.package_dir(), self.workdir / "lib")): runtime.LIB_IN_SANDBOX}
        vscode = confinement.vscode_home()
        if vscode:
            try:
                runtime_binds[runtime.stage_tree(vscode, "vscode")] = confinement.VSCODE_IN_SANDBOX
            except (RuntimeError, OSError) as e:
                log.warning("VS Code at %s is left out of the sandbox: %s", vscode, e)
                vscode = None
        sudo_boot = _SUDO_BOOT.format(paths=[runtime.LIB_IN_SANDBOX, *python.site])
        sudo_client = " ".join(shlex.quote(part) for part in (
            *(["env", *(f"{k}={v}" for k, v in python_env.items())] if python_env else []),
            python.python, "-I", "-c", sudo_boot, "client")) if as_root else None
        bin_dir = confinement.write_python_shim(self.workdir, python.python, list(python.site), environment=python_env,
                                                vscode=confinement.VSCODE_IN_SANDBOX if vscode else None,
                                                sudo_client=sudo_client)
        self._runtime_paths = [*runtime_binds, *(binds or {})]  # what the sandbox's uid must be able to read
        if window_manager == "gnome":
            try:
                gnome.write_session_files(bin_dir, confinement.SHIM_DIR_IN_SANDBOX)
            except (RuntimeError, OSError) as e:
                raise SandboxError(f"cannot prepare the GNOME session: {e}") from e
        if as_root:
            self._claim_id_block()
        elif os.geteuid() == 0:
            self._drop_to_unprivileged_uid()
        filter_path = self.workdir / "control" / "seccomp.bpf"
        with open(filter_path, "wb") as out:
            unknown = confinement.seccomp_filter_bpf(out)
        if unknown:
            log.debug("seccomp: this libseccomp does not know %s", unknown)
        seccomp_fd = os.open(filter_path, os.O_RDONLY)
        self._fds_to_close = [seccomp_fd]
        if self.network == "user" and not as_root:  # its resolver: pasta's forwarder (the host's /etc/resolv.conf stays masked)
            (self.workdir / "resolv.conf").write_text(usernet.resolv_conf())
            (self.workdir / "resolv.conf").chmod(0o644)
            binds = {**(binds or {}), str(self.workdir / "resolv.conf"): "/etc/resolv.conf"}
        args = confinement.bwrap_arguments(self.workdir, self.limits, network=network, seccomp_fd=seccomp_fd,
                                           binds={**runtime_binds, **(binds or {})},
                                           environment={**confinement.sandbox_environment(), **python_env},
                                           system_root=superuser.SYSTEM_ROOT if as_root else None)
        # The options through a descriptor, the environment the sandbox's own: PID 1 inside is
        # bubblewrap, and its command line and environment are readable there.
        args_path = self.workdir / "control" / "bwrap.args"
        args_path.write_bytes(b"".join(a.encode() + b"\0" for a in args))
        args_fd = os.open(args_path, os.O_RDONLY)
        self._fds_to_close.append(args_fd)
        server = self._server_arguments(listen_fd, window_manager, python.python, list(python.site), runtime.LIB_IN_SANDBOX)
        server += ["--display", ":0", "--bin-dir", confinement.SHIM_DIR_IN_SANDBOX, "--home", HOME_IN_SANDBOX,
                   "--runtime-dir", gnome.RUNTIME_DIR if window_manager == "gnome" else "/tmp/runtime",
                   "--log-dir", "/tmp/launched"]
        if not as_root:
            command = [shutil.which("bwrap") or "bwrap", "--args", str(args_fd), *server]
            return command, (listen_fd, seccomp_fd, args_fd), {"PATH": confinement.SANDBOX_PATH}, "/"
        # Root inside: the outer namespace (superuser.py) runs the overlay and then this bubblewrap,
        # whose first process (sudo.py's init) starts the broker and becomes the server as `user`.
        assert self.id_block is not None
        seed = self.workdir / "seed"
        shutil.rmtree(seed, ignore_errors=True)
        superuser.write_seed(seed, self.id_block, usernet.resolv_conf() if self.network == "user" else None)
        self.grants = superuser.Grants()
        sources = [*runtime_binds, *(binds or {}), str(bin_dir)]
        self._outer = superuser.OuterStart(self.id_block, superuser.outer_arguments(
            seed, layer_mib=self.limits.system_mib, share_network=network, binds=sources), args_fd)
        init = [python.python, "-I", "-c", sudo_boot, "init", "--grant-fd", str(self.grants.write_fd),
                "--limits", json.dumps(self.limits.as_dict()), "--home", HOME_IN_SANDBOX,
                "--host-pid-namespace", os.readlink("/proc/self/ns/pid"), "--", *server]
        pass_fds = (listen_fd, seccomp_fd, args_fd, self.grants.write_fd, *self._outer.pass_fds)
        return self._outer.command(init), pass_fds, {"PATH": confinement.SANDBOX_PATH}, "/"

    def _claim_id_block(self) -> None:
        """With root inside: the sandbox's block of host uids (kept for its whole life, relaunches
        included), which must be able to read what the sandbox binds: there is no falling back to a
        sandbox whose root would be the host's."""
        if self.id_block is None:
            self.id_block, self._uid_lock = claim_id_block()
        self.host_uid = self.id_block + confinement.USER_ID
        self.workdir.chmod(0o711)  # the outer namespace binds the shims, the package copy and the seed from here
        unreadable = _unreadable_for(self.id_block, self._runtime_paths)
        if unreadable:
            raise SandboxError(f"env.options.sudo=root: an unprivileged uid cannot read {unreadable}, which the sandbox "
                               "binds (the sandbox's root is such a uid on the host): make them world-readable")

    def _drop_to_unprivileged_uid(self) -> None:
        """Started by root, bubblewrap would map the sandbox's user to root: its processes would
        count as root for the kernel (no process limit, root's files readable where mounted). So
        bubblewrap runs as an unprivileged uid of its own instead, when that uid can read everything
        the sandbox binds: its staged Python (runtime.py, world-readable wherever the environment
        it came from lives), the package copy and shims in the work directory, and the caller's
        binds; where one of those is unreadable to it (a directory under /root, mode 0700) the
        mapping stays root and the mount list and the server's watcher are the protection
        (report() says which)."""
        # The uid passes through the work directory to what it binds from there (the package copy,
        # the shims, the identity files) before it is asked what it can read: asked while the
        # directory was still 0700, the answer was always "nothing", and the user mapped to root.
        self.workdir.chmod(0o711)  # control/ stays 0700: the socket, the seccomp filter, the options
        for name in confinement.IDENTITY_FILES:
            (self.workdir / name).chmod(0o644)
        unreadable = _unreadable_for(AGENT_UIDS.stop - 1, self._runtime_paths)
        if unreadable:
            self.workdir.chmod(0o700)
            log.debug("desktop sandbox: the sandbox's user maps to root (an unprivileged uid cannot read %s)", unreadable)
            return
        self.host_uid, self._uid_lock = _claim_free_uid()

    def _user_command(self, listen_fd: int, network: bool,
                      window_manager: str) -> tuple[list[str], tuple[int, ...], dict[str, str], str]:
        """The fallback: the server on the host as root, the agent's programs as a fresh uid, in a
        home only that uid may enter, with the network blocked for it where iptables works."""
        self.agent_uid, gid, self._uid_lock = _claim_agent_account()
        self._agent_gid = gid
        self._home_lock = _claim_user_home(self.agent_uid, gid)
        self.workdir.chmod(0o711)  # the agent's uid may pass through to its runtime directory, nothing else
        runtime = self.workdir / "runtime"
        runtime.mkdir(mode=0o700)
        os.chown(runtime, self.agent_uid, gid)
        if not network:
            self.network_blocked = _block_network(self.agent_uid, True)
        missing = _unreadable_for(self.agent_uid, [sys.executable, confinement.package_dir()])
        if missing:
            log.warning("desktop sandbox (user mode): the agent's uid cannot read %s: trusted commands that "
                        "run Python as the agent will fail", missing)
        log.warning("desktop sandbox in the 'user' fallback (no user namespaces here): it does not promise: %s",
                    "; ".join(confinement.USER_MODE_LOSSES))
        # python/python3 shims only where the agent's uid can run this interpreter (else its
        # system python3 stays what those names run)
        bin_dir = confinement.write_python_shim(self.workdir, sys.executable, confinement.site_directories(),
                                                pythons=not missing)
        command = [*self._server_arguments(listen_fd, window_manager), "--agent-uid", str(self.agent_uid),
                   "--bin-dir", str(bin_dir),
                   "--agent-gid", str(gid),
                   "--home", HOME_IN_SANDBOX, "--runtime-dir", str(runtime),
                   "--log-dir", str(self.workdir / "control" / "launched"), "--die-with-parent"]
        return command, (listen_fd,), {"PATH": confinement.SANDBOX_PATH, "LANG": "C.UTF-8"}, "/"

    def _start_watcher(self, gid: int | None = None) -> subprocess.Popen:
        """A small shell that waits for this process to close its pipe (on close(), or when the
        kernel closes it because this process died) and then cleans up: the work directory, and in
        user mode the server's process group, every process of the agent's uid and its firewall rule.
        The first line it reads is the server's process group (known once the server started)."""
        script = 'read pgid; read _; '
        if self.isolation == "user":
            script += ('kill -KILL -- -"$pgid" 2>/dev/null; setpriv --reuid "$1" --regid "$2" --clear-groups '
                       'kill -KILL -1 2>/dev/null; ')
            if self.network_blocked:
                script += " ".join(f'{tool} -w -D OUTPUT -m owner --uid-owner "$1" -j REJECT 2>/dev/null;'
                                   for tool in ("iptables", "ip6tables") if shutil.which(tool))
            script += f'rm -rf -- {HOME_IN_SANDBOX}; '
        script += ('rm -rf -- "$0"; shift 2; for i in 1 2 3 4 5 6 7 8 9 10; do rmdir "$@" 2>/dev/null; left=; '
                   'for d; do [ -d "$d" ] && left=1; done; [ -z "$left" ] && break; sleep 1; done')
        cgroups = [str(d) for d in self.cgroup.directories.values()] if self.cgroup is not None else []
        return subprocess.Popen(["/bin/sh", "-c", script, str(self.workdir), str(self.agent_uid or ""), str(gid or ""),
                                 *cgroups],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)

    def _wait_ready(self) -> None:
        assert self._watcher is not None and self._watcher.stdin is not None
        if not self._watcher_told:  # its first line: the server's process group
            self._watcher.stdin.write(f"{self.process.pid}\n".encode())
            self._watcher.stdin.flush()
            self._watcher_told = True
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self._log_tail()
                self.close()
                raise SandboxError(f"the desktop sandbox exited at start (code {self.process.returncode}): {tail}")
            try:
                self.get_json("/health", timeout=2)
                return
            except (OSError, SandboxError):
                time.sleep(0.05)
        tail = self._log_tail()
        self.close()
        raise SandboxError(f"the desktop sandbox did not answer within {START_TIMEOUT_S:.0f} s: {tail}")

    def _log_tail(self) -> str:
        """The end of the sandbox's output, for an error to quote: once its process exited, all of it
        (the reader is given a moment to reach the end)."""
        if self._output is None:
            return ""
        if self.process.poll() is not None:
            self._output.wait(timeout=2)
        return self._output.text()[-1500:]

    # -- HTTP -------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: dict[str, Any] | bytes | None = None,
                timeout: float = 180.0, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """One HTTP request to the server; `body` a JSON-able mapping, or raw bytes as given."""
        if self.process.poll() is not None:
            raise SandboxError(f"the desktop sandbox has exited (code {self.process.returncode}): {self._log_tail()}")
        connection = _UnixConnection(self.socket_path, timeout)
        try:
            if isinstance(body, bytes):
                payload, kind = body, (headers or {}).get("Content-Type", "application/octet-stream")
            else:
                payload, kind = (json.dumps(body).encode() if body is not None else None), "application/json"
            connection.request(method, path, body=payload, headers={"Content-Type": kind} if payload is not None else {})
            response = connection.getresponse()
            return response.status, response.read()
        except (OSError, http.client.HTTPException) as e:
            raise SandboxError(f"desktop sandbox {method} {path} failed: {e}") from e
        finally:
            connection.close()

    def get_json(self, path: str, timeout: float = 60.0) -> Any:
        status, data = self.request("GET", path, timeout=timeout)
        if status != 200:
            raise SandboxError(f"desktop sandbox GET {path}: HTTP {status}: {data[:300]!r}")
        return json.loads(data)

    def post_json(self, path: str, body: dict[str, Any], timeout: float = 180.0) -> Any:
        status, data = self.request("POST", path, body, timeout=timeout)
        if status not in (200, 403):
            raise SandboxError(f"desktop sandbox POST {path}: HTTP {status}: {data[:300]!r}")
        return json.loads(data)

    # -- what environments and checkers use ---------------------------------------------------
    def screenshot(self) -> bytes:
        status, data = self.request("GET", "/screenshot", timeout=60)
        if status != 200:
            raise SandboxError(f"screenshot failed: HTTP {status}")
        return data

    def execute(self, command: list[str] | str, shell: bool = False, timeout: float = 120.0) -> dict[str, Any]:
        """Run a trusted command (task set-up, checkers) inside the sandbox, as its user, and wait."""
        return self.post_json("/execute", {"command": command, "shell": shell, "timeout": timeout},
                              timeout=timeout + 30)

    def launch(self, command: list[str] | str, shell: bool = False) -> None:
        self.post_json("/setup/launch", {"command": command, "shell": shell})

    def launched(self) -> list[dict[str, Any]]:
        """The applications launched since the last reset: command, pid, returncode (None while
        running) and the tail of their stdout+stderr."""
        return self.get_json("/setup/launched")

    def read_file(self, path: str) -> bytes | None:
        """A file of the desktop (`~/...` in its home), read as the sandbox's user; None if absent."""
        status, data = self.request("POST", "/file", {"file_path": path})
        return data if status == 200 else None

    def path_info(self, paths: list[str]) -> dict[str, dict[str, Any] | None]:
        """Kind ("dir", "file", ...) and mode of each path, None where absent, read by the server
        itself: no process a program of the agent could write into answers for it."""
        return self.post_json("/path_info", {"paths": list(paths)})["info"]

    def run_action(self, code: str) -> dict[str, Any]:
        """Agent code: the server runs it only if `check_action_code` accepts it (else status 'refused')."""
        return self.post_json("/run_action", {"code": code}, timeout=ACTION_TIMEOUT_S + 30)

    def active_window(self) -> dict[str, Any]:
        return self.get_json("/active_window")

    def accessibility_tree(self, budget_s: float | None = None) -> str:
        """The desktop's AT-SPI tree in OSWorld's XML (root `desktop-frame`; a `truncated` attribute
        on it says what a limit cut). SandboxError where the machine cannot serve it (the reason names
        the missing package) or the reading failed."""
        query = "" if budget_s is None else f"?budget_s={budget_s:g}"
        budget = a11y.BUDGET_S if budget_s is None else budget_s
        return self.get_json(f"/accessibility{query}", timeout=budget + a11y.GRACE_S + 30)["AT"]

    def windows(self) -> list[dict[str, Any]]:
        """The desktop's top-level windows, oldest first ({"id", "title", "wm_class", "x", "y",
        "width", "height"})."""
        return self.get_json("/windows")

    def wait_for_windows(self, timeout: float, quiet_s: float = 1.0) -> bool:
        """Until at least one window exists and the windows (titles, sizes) have not changed for
        `quiet_s`; False if that did not happen within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        last, since = None, time.monotonic()
        while time.monotonic() < deadline:
            now = self.windows()
            if now != last:
                last, since = now, time.monotonic()
            elif now and time.monotonic() - since >= quiet_s:
                return True
            time.sleep(0.2)
        return False

    def settle(self, timeout: float, quiet_s: float = 1.0, busy_cores: float = 0.2) -> float:
        """Wait until the desktop is still: the windows (titles, sizes) unchanged and the episode's
        programs using under `busy_cores` of CPU for `quiet_s` seconds, or `timeout`. What a task's
        set-up started is then drawn (a browser that opens a window) or idle (a command that opens
        none costs `quiet_s`, not the timeout). Returns the seconds waited."""
        started = time.monotonic()
        last = self.get_json("/activity")
        last_t = since = time.monotonic()
        while time.monotonic() - started < timeout:
            time.sleep(0.25)
            now = self.get_json("/activity")
            t = time.monotonic()
            cores = (now["cpu_s"] - last["cpu_s"]) / max(t - last_t, 1e-3)
            if now["windows"] != last["windows"] or cores > busy_cores:
                since = t
            elif t - since >= quiet_s:
                break
            last, last_t = now, t
        return time.monotonic() - started

    def reset_session(self) -> int:
        """End every application and empty the home directory; returns how many processes ended.
        With root inside, after an episode in which root was granted: a new sandbox instead, from
        a fresh system layer (what root did may be anywhere in the system); its desktop starts as
        a reset leaves one (0 returned)."""
        if self.grants is not None and self.grants.granted():
            self._relaunch()
            return 0
        return int(self.post_json("/session/reset", {}, timeout=60)["ended"])

    def _relaunch(self) -> None:
        self._stop_process()
        if self.usernet is not None:
            self.usernet.close()
            self.usernet = None
        if self.grants is not None:
            self.grants.close()
            self.grants = None
        self._launch()

    def alive(self) -> bool:
        return self.process.poll() is None

    def report(self) -> dict[str, Any]:
        """How this sandbox is confined: mode, limits, and what the mode does not promise."""
        return {"isolation": self.isolation, "limits": self.limits.as_dict(), "network_blocked": self.network_blocked,
                "network": self.network, "sudo": self.sudo,
                "root_ids": [self.id_block, self.id_block + superuser.ID_COUNT - 1] if self.id_block is not None else None,
                "network_fenced": self.usernet.blocked if self.usernet is not None else [],
                "agent_uid": self.agent_uid, "host_uid": self.host_uid if self.isolation == "namespaces" else self.agent_uid,
                "cgroup": self.cgroup.kind if self.cgroup is not None else None, "seccomp": self.isolation == "namespaces",
                "sized_tmpfs": self.isolation == "namespaces" and "--size" in confinement.bwrap_features(),
                "losses": list(confinement.USER_MODE_LOSSES) if self.isolation == "user" else []}

    def describe(self) -> str:
        """One line: how this sandbox is isolated (logged once per process and mode)."""
        report = self.report()
        if self.isolation == "user":
            return (f"desktop sandbox: 'user' isolation (dedicated account uid {self.agent_uid}; network "
                    f"{'blocked' if self.network_blocked else 'NOT blocked'}; see report()['losses'])")
        who = f"uid {self.host_uid}" if self.host_uid is not None else (
            "root" if os.geteuid() == 0 else f"your uid {os.geteuid()}")
        limits = (f"cgroup {report['cgroup']} limits" if report["cgroup"] else
                  "rlimits" if who != "root" else "the server's watcher (no cgroup could be made)")
        root = (f"; root inside (sudo), host uids {self.id_block}.. over a {self.limits.system_mib} MiB writable "
                "system layer" if self.sudo == "root" else "")
        return (f"desktop sandbox: 'namespaces' isolation (bubblewrap; seccomp; "
                f"{'size-capped' if report['sized_tmpfs'] else 'UNCAPPED (bubblewrap < 0.7)'} home; "
                f"the sandbox's user maps to {who}; process limit: {limits}{root})")

    def close(self) -> None:
        """End the sandbox and everything in it; remove its directory. Safe to call twice."""
        self._stop_process()
        self._cleanup_files()

    def _stop_process(self) -> None:
        if self.sudo == "root" and getattr(self, "process", None) is not None and self.process.poll() is None:
            # Nothing of it is kept: the outer bubblewrap's end ends its PID namespace, and
            # everything in it, at once.
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        if getattr(self, "process", None) is not None and self.process.poll() is None:
            try:
                self.request("POST", "/shutdown", {}, timeout=5)
            except SandboxError:
                pass
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)

    def _cleanup_files(self) -> None:
        if getattr(self, "usernet", None) is not None:
            self.usernet.close()
            self.usernet = None
        if getattr(self, "grants", None) is not None:
            self.grants.close()
            self.grants = None
        if self.cgroup is not None and self.cgroup.remove():  # before the watcher, which would wait for it
            self.cgroup = None
        watcher = getattr(self, "_watcher", None)
        if watcher is not None and watcher.poll() is None:
            try:
                assert watcher.stdin is not None
                watcher.stdin.close()  # it cleans up (user mode: the agent's uid and its firewall rule)
                watcher.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                pass
        shutil.rmtree(self.workdir, ignore_errors=True)
        for name in ("_home_lock", "_uid_lock"):  # the watcher emptied /home/user first (user mode)
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _OutputTail:
    """The last `keep` bytes a process writes to `stream`, in memory (read by a thread until EOF)."""

    def __init__(self, stream: Any, keep: int = 65536) -> None:
        self._stream, self._keep, self._data = stream, keep, b""
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while chunk := self._stream.read1(65536):
            with self._lock:
                self._data = (self._data + chunk)[-self._keep:]
        self._stream.close()

    def wait(self, timeout: float) -> None:
        """Until the stream's end was read (every writer closed it), at most `timeout` seconds."""
        self._reader.join(timeout)

    def text(self) -> str:
        with self._lock:
            return self._data.decode(errors="replace")


_SAID: set[str] = set()


def _say_once(line: str) -> None:
    if line not in _SAID:
        _SAID.add(line)
        log.info("%s", line)


# ---- the user-mode fallback --------------------------------------------------------------------

def _claim_agent_account() -> tuple[int, int, int]:
    """A dedicated account for this sandbox's agent: (uid, gid, lock descriptor). Accounts named
    `arpo-desktop-<uid>` are reused when no other sandbox holds them (flock, released when the
    descriptor closes or this process dies); when all are held, a new system account is created
    (applications need a passwd entry: a terminal refuses to start without one)."""
    UID_LOCKS.mkdir(mode=0o700, exist_ok=True)
    accounts = sorted((p.pw_uid, p.pw_gid) for p in pwd.getpwall() if p.pw_name.startswith(AGENT_ACCOUNT_PREFIX))
    for uid, gid in accounts:
        fd = _try_lock(uid)
        if fd is not None:
            if pwd.getpwuid(uid).pw_dir != HOME_IN_SANDBOX:  # applications (a terminal) take the home from passwd
                subprocess.run(["usermod", "--home", HOME_IN_SANDBOX, pwd.getpwuid(uid).pw_name], capture_output=True)
            subprocess.run(["/bin/sh", "-c", "kill -KILL -1"], user=uid, group=gid, extra_groups=[],
                           capture_output=True)  # leftovers of a sandbox whose host process was killed
            return uid, gid, fd
    busy = {confinement.process_uid(e.name) for e in os.scandir("/proc") if e.name.isdigit()}
    taken = {p.pw_uid for p in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
    for uid in AGENT_UIDS:
        if uid in busy or uid in taken:
            continue
        fd = _try_lock(uid)
        if fd is None:
            continue
        if not shutil.which("useradd"):
            os.close(fd)
            raise SandboxError("the 'user' isolation creates a dedicated account with useradd, which is not installed")
        done = subprocess.run(["useradd", "--system", "--uid", str(uid), "--user-group", "--no-create-home",
                               "--home-dir", HOME_IN_SANDBOX, "--shell", "/bin/bash", f"{AGENT_ACCOUNT_PREFIX}{uid}"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            os.close(fd)
            raise SandboxError(f"cannot create the agent account {AGENT_ACCOUNT_PREFIX}{uid}: {done.stderr.strip()}")
        log.warning("desktop sandbox (user mode): created the system account %s%d for the agent's programs",
                    AGENT_ACCOUNT_PREFIX, uid)
        entry = pwd.getpwnam(f"{AGENT_ACCOUNT_PREFIX}{uid}")
        return entry.pw_uid, entry.pw_gid, fd
    raise SandboxError(f"no free agent uid in {AGENT_UIDS.start}..{AGENT_UIDS.stop - 1}")


AGENT_ACCOUNT_PREFIX = "arpo-desktop-"


def _claim_user_home(uid: int, gid: int) -> int:
    """User mode: the agent's home is the host's /home/user (OSWorld's task files name it), so one
    such sandbox runs per machine at a time. Created for the agent, or taken over when an earlier
    sandbox left it; refused when it belongs to anyone else. Returns the lock's descriptor."""
    fd = os.open(UID_LOCKS / "home.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SandboxError(f"the 'user' isolation runs one desktop per machine ({HOME_IN_SANDBOX} is its home, "
                       "as OSWorld's tasks expect) and another one is running") from None
    home = Path(HOME_IN_SANDBOX)
    try:
        info = home.lstat()
    except FileNotFoundError:
        home.mkdir(mode=0o700, parents=True)
        os.chown(home, uid, gid)
        return fd
    try:
        owner = pwd.getpwuid(info.st_uid).pw_name
    except KeyError:
        owner = str(info.st_uid)
    if not home.is_dir() or home.is_symlink() or not owner.startswith(AGENT_ACCOUNT_PREFIX):
        os.close(fd)
        raise SandboxError(f"the 'user' isolation needs {HOME_IN_SANDBOX} for the agent (OSWorld's tasks name it), "
                       f"but it exists here and belongs to {owner}")
    os.chown(home, uid, gid)
    os.chmod(home, 0o700)
    return fd


def _claim_free_uid() -> tuple[int, int]:
    """A uid no account and no process uses, locked for this sandbox: (uid, lock descriptor)."""
    UID_LOCKS.mkdir(mode=0o700, exist_ok=True)
    busy = {confinement.process_uid(e.name) for e in os.scandir("/proc") if e.name.isdigit()}
    taken = {p.pw_uid for p in pwd.getpwall()}
    for uid in AGENT_UIDS:
        if uid not in busy and uid not in taken:
            fd = _try_lock(uid)
            if fd is not None:
                return uid, fd
    raise SandboxError(f"no free uid in {AGENT_UIDS.start}..{AGENT_UIDS.stop - 1}")


def claim_id_block() -> tuple[int, int]:
    """With root inside: the first of superuser.ID_COUNT consecutive host uids (the same numbers
    as gids) that no account, group, process or subordinate id range (/etc/subuid, /etc/subgid)
    uses, locked for this sandbox: (first uid, lock descriptor)."""
    UID_LOCKS.mkdir(mode=0o700, exist_ok=True)
    used = {p.pw_uid for p in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
    used |= {uid for e in os.scandir("/proc") if e.name.isdigit() and (uid := confinement.process_uid(e.name)) is not None}
    ranges = [range(start, start + count) for start, count in _subordinate_ranges()]
    for first in ID_BLOCKS:
        block = range(first, first + superuser.ID_COUNT)
        if any(i in block for i in used) or any(r.start < block.stop and block.start < r.stop for r in ranges):
            continue
        fd = _try_lock(first)
        if fd is not None:
            return first, fd
    raise SandboxError(f"no free block of {superuser.ID_COUNT} host uids from {ID_BLOCKS.start}")


def _subordinate_ranges() -> list[tuple[int, int]]:
    """(first, count) of every range /etc/subuid and /etc/subgid give out (rootless containers')."""
    ranges = []
    for path in ("/etc/subuid", "/etc/subgid"):
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.split(":")
            if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                ranges.append((int(parts[1]), int(parts[2])))
    return ranges


def _try_lock(uid: int) -> int | None:
    fd = os.open(UID_LOCKS / f"{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _block_network(uid: int, block: bool) -> bool:
    """Add (or remove) a firewall rule rejecting every packet the uid sends; whether it holds."""
    tools = [t for t in ("iptables", "ip6tables") if shutil.which(t)]
    if not tools:
        return False
    ok = True
    for tool in tools:
        done = subprocess.run([tool, "-w", "-A" if block else "-D", "OUTPUT", "-m", "owner", "--uid-owner", str(uid),
                               "-j", "REJECT"], capture_output=True)
        ok = ok and done.returncode == 0
    return ok and block


def _unreadable_for(uid: int, paths: list[str]) -> list[str]:
    """Those of `paths` the uid cannot reach (a directory on the way without search permission)."""
    missing = []
    for path in paths:
        done = subprocess.run(["test", "-r", path], user=uid, group=uid, extra_groups=[], capture_output=True)
        if done.returncode != 0:
            missing.append(path)
    return missing
