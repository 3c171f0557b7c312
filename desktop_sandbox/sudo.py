"""Root inside a sandbox started with `sudo="root"` (superuser.py: how the host sets it up). Three
entry points, one per process that runs this file inside the sandbox:

    init    the sandbox's first process, started by bubblewrap as root of the sandbox's user
            namespace (no capability over the host), under the sandbox's seccomp filter and
            no_new_privs. It gives `user` the directories the desktop writes, removes from every
            process to come the capabilities root inside never has (CAP_SYS_PTRACE: the action
            server and the broker are undumpable, and must stay so to root too; CAP_NET_ADMIN: the
            user-mode network's fence), starts the broker and becomes the action server as `user`.
    broker  stays root, undumpable, listening on BROKER_SOCKET in a directory only root may write.
            A request carries the command, the password, the caller's working directory and
            environment and, as SCM_RIGHTS, its standard streams (the terminal). The broker checks
            the password, reports the grant to the host (`--grant-fd`: a pipe only the host reads;
            written before the command runs, so no command can keep it from the host), runs the
            command in a session of its own on those streams with sudo's environment, forwards the
            caller's signals to it and answers its exit status.
            It also ends the episode's processes when the action server asks (a limit crossed, a
            reset): the server runs as `user` and may not signal root's. The server asks over a
            socket pair init made (`BrokerChannel`): it has no path, and its one other end is the
            undumpable server's, which no process of the sandbox can open or take.
    client  what the `sudo` shim runs once it has the password (confinement.SUDO_SHIM): it sends the
            request and exits as the command did.

The command has no controlling terminal (it would have to take the caller's): a shell it starts
(`sudo -i`, `sudo -s`) says it has no job control; everything else on the terminal works (prompts,
passwords, colours, Ctrl+C).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import pwd
import selectors
import shlex
import signal
import socket
import sys
import threading
from typing import Any

BROKER_DIR = "/run/sudo"
BROKER_SOCKET = f"{BROKER_DIR}/broker.sock"
PASSWORD = "password"
"""OSWorld's VM user's password (the shim asks for it the same way)."""
USER_ID = 1000
USER_DIRS = {"/run/user/1000": (0o700, USER_ID), "/run/dbus": (0o755, USER_ID), "/run/lock": (0o1777, 0)}
"""Under /run (root's, as on the VM): what the desktop, running as `user`, writes there."""
CAPS_NEVER_GIVEN = {"CAP_NET_ADMIN": 12, "CAP_SYS_PTRACE": 19}
"""Capabilities no process of the sandbox keeps, root inside included (see the module docstring)."""
SECURE_PATH = "/opt/arpo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""sudo's PATH (Ubuntu's secure_path), after the sandbox's trusted shims (`python3` with pyautogui)."""
KEPT_VARIABLES = ("TERM", "COLORTERM", "DISPLAY", "XAUTHORITY", "LANG", "LANGUAGE", "TZ", "COLUMNS", "LINES",
                  "LS_COLORS", "PS1", "PS2")
"""What sudo keeps of the caller's environment (its env_reset defaults; LC_* too)."""
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                     signal.SIGUSR2, signal.SIGWINCH)
MAX_REQUEST_BYTES = 1 << 20
PR_CAPBSET_DROP = 24


# ---- init ---------------------------------------------------------------------------------------

def init(grant_fd: int, limits: dict[str, int], home: str, server: list[str], host_pid_namespace: str) -> None:
    """As root inside: prepare, start the broker, become the action server as `user` (never returns)."""
    os.chown(home, USER_ID, USER_ID)
    for path, (mode, owner) in USER_DIRS.items():
        os.makedirs(path, exist_ok=True)
        os.chown(path, owner, owner)
        os.chmod(path, mode)
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in CAPS_NEVER_GIVEN.values():
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"cannot drop capability {cap} from the bounding set")
    os.makedirs(BROKER_DIR, mode=0o755, exist_ok=True)
    os.chmod(BROKER_DIR, 0o755)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(BROKER_SOCKET)
    os.chmod(BROKER_SOCKET, 0o666)
    listener.listen(16)
    for_broker, for_server = socket.socketpair()
    broker = os.fork()
    if broker == 0:
        try:
            from desktop_sandbox import processes

            processes.HOST_PID_NAMESPACE = host_pid_namespace  # its kill(-1) is refused there
            for_server.close()
            _close_all_but(0, 1, 2, listener.fileno(), grant_fd, for_broker.fileno())  # the server's listening socket among them
            Broker(listener, grant_fd, limits, for_broker).serve()
        finally:
            os._exit(1)
    listener.close()
    for_broker.close()
    os.close(grant_fd)
    os.set_inheritable(for_server.fileno(), True)
    os.setgroups([])
    os.setresgid(USER_ID, USER_ID, USER_ID)
    os.setresuid(USER_ID, USER_ID, USER_ID)  # every capability goes with root
    os.execv(server[0], [*server, "--keep-pid", str(broker), "--broker-fd", str(for_server.fileno())])


# ---- broker -------------------------------------------------------------------------------------

class Broker:
    """Runs `sudo`'s commands as root (see the module docstring)."""

    def __init__(self, listener: socket.socket, grant_fd: int, limits: dict[str, int], server: socket.socket) -> None:
        from desktop_sandbox.processes import no_dump, set_limits

        no_dump()
        set_limits(limits)
        os.set_blocking(grant_fd, False)
        self.listener, self.grant_fd, self.server = listener, grant_fd, server

    def serve(self) -> None:
        """sudo's callers, each in a thread of its own, and the server's requests, answered here:
        a fork bomb of root's may leave no thread to start."""
        selector = selectors.DefaultSelector()
        selector.register(self.listener, selectors.EVENT_READ)
        selector.register(self.server, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj is self.server:
                    if not self._answer_server():
                        selector.unregister(self.server)  # the server is gone: so is the desktop
                    continue
                connection, _ = self.listener.accept()
                try:
                    threading.Thread(target=self._answer, args=(connection,), daemon=True).start()
                except RuntimeError:  # no thread can start (root's processes are at their limit)
                    connection.close()

    def _answer_server(self) -> bool:
        """One request of the action server's: end every process of the episode but those it
        keeps (`{"end": [pids to keep], "deadline_s": s}`), answered `{"ended": n}` or `{"error"}`.
        False when the server closed its end."""
        from desktop_sandbox.processes import end_all_but

        try:
            data = _receive_line(self.server)
        except OSError:
            return False
        try:
            request = json.loads(data)
            answer: dict[str, Any] = {"ended": end_all_but({int(pid) for pid in request["end"]},
                                                           float(request["deadline_s"]))}
        except Exception as e:  # noqa: BLE001 - said to the server, which reports it
            answer = {"error": str(e)}
        try:
            _send(self.server, answer)
        except OSError:
            return False
        return True

    def _answer(self, connection: socket.socket) -> None:
        streams: list[int] = []
        try:
            request, streams = _receive_request(connection)
            caller = _peer_uid(connection)
            process = self._start(request, streams, caller)
            if isinstance(process, str):
                _send(connection, {"error": process, "exit": 1})
                return
            for fd in streams:
                os.close(fd)
            streams = []
            _send(connection, {"exit": _wait_relaying_signals(process, connection)})
        except Exception as e:  # whatever a caller sends, the broker goes on serving the others
            try:
                _send(connection, {"error": f"sudo: {e}", "exit": 1})
            except OSError:
                pass
        finally:
            for fd in streams:
                os.close(fd)
            connection.close()

    def _start(self, request: dict[str, Any], streams: list[int], caller: int) -> Any:
        """The command's process, or why it was not started (sudo's words)."""
        import subprocess

        if request.get("password") != PASSWORD:
            return "Sorry, try again.\nsudo: 1 incorrect password attempt"
        try:
            target = _account(str(request.get("user") or "root"))
        except KeyError:
            return f"sudo: unknown user {request.get('user')}"
        argv = [str(a) for a in request.get("argv") or []]
        if request.get("login") or request.get("shell"):
            shell = target.pw_shell or "/bin/bash"
            argv = [shell, *(["-l"] if request.get("login") else []),
                    *(["-c", " ".join(shlex.quote(a) for a in argv)] if argv else [])]
        if not argv:
            return "usage: sudo [-u user] [-i | -s] [command [arg ...]]"
        cwd = target.pw_dir if request.get("login") else str(request.get("cwd") or "/")
        if not os.path.isdir(cwd):
            cwd = "/"
        env = _sudo_environment(dict(request.get("env") or {}), target, caller, argv, bool(request.get("keep_env")))
        groups = os.getgrouplist(target.pw_name, target.pw_gid)
        self._report_grant()
        try:
            return subprocess.Popen(argv, stdin=streams[0], stdout=streams[1], stderr=streams[2], cwd=cwd, env=env,
                                    user=target.pw_uid, group=target.pw_gid, extra_groups=groups,
                                    start_new_session=True, close_fds=True)
        except FileNotFoundError:
            return f"sudo: {argv[0]}: command not found"
        except OSError as e:
            return f"sudo: unable to execute {argv[0]}: {e.strerror}"

    def _report_grant(self) -> None:
        try:
            os.write(self.grant_fd, b"g")
        except BlockingIOError:  # the pipe is full: the host knows already
            pass


def _wait_relaying_signals(process: Any, connection: socket.socket) -> int:
    """Until the command ends: the caller's signals go to its process group. Its exit status as a
    shell reports it (128 + the signal that ended it)."""
    selector = selectors.DefaultSelector()
    pidfd = os.pidfd_open(process.pid)
    selector.register(pidfd, selectors.EVENT_READ)
    selector.register(connection, selectors.EVENT_READ)
    pending = b""
    try:
        while True:
            for key, _ in selector.select():
                if key.fileobj == pidfd:
                    code = process.wait()
                    return code if code >= 0 else 128 - code
                data = connection.recv(4096)
                if not data:  # the caller is gone; the command goes on, as sudo's does when killed
                    selector.unregister(connection)
                    continue
                pending += data
                if len(pending) > 65536:
                    raise ValueError("too many signal messages at once")
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    message = json.loads(line)
                    number = int(message.get("signal", 0)) if isinstance(message, dict) else 0
                    if number in {int(s) for s in FORWARDED_SIGNALS}:
                        try:
                            os.killpg(process.pid, number)
                        except ProcessLookupError:
                            pass
    finally:
        selector.close()
        os.close(pidfd)


def _close_all_but(*keep: int) -> None:
    for name in os.listdir("/proc/self/fd"):
        if int(name) not in keep:
            try:
                os.close(int(name))
            except OSError:  # the directory's own descriptor, closed already
                pass


def _account(name: str) -> pwd.struct_passwd:
    """sudo's -u argument: a name or #uid of the sandbox's passwd (root by default)."""
    if name.startswith("#") and name[1:].isdigit():
        return pwd.getpwuid(int(name[1:]))
    return pwd.getpwnam(name)


def _sudo_environment(caller_env: dict[str, str], target: pwd.struct_passwd, caller: int, argv: list[str],
                      keep_all: bool) -> dict[str, str]:
    """What sudo gives the command: the caller's environment (-E) or its few kept variables, then
    the target's HOME, USER, LOGNAME, SHELL, MAIL, the secure PATH and SUDO_*. Never LD_*."""
    if keep_all:
        env = {k: v for k, v in caller_env.items() if not k.startswith(("LD_", "BASH_FUNC_"))}
    else:
        env = {k: v for k, v in caller_env.items() if k in KEPT_VARIABLES or k.startswith("LC_")}
    try:
        caller_name = pwd.getpwuid(caller).pw_name
    except KeyError:
        caller_name = str(caller)
    try:
        caller_gid = pwd.getpwuid(caller).pw_gid
    except KeyError:
        caller_gid = caller
    env.update(HOME=target.pw_dir, USER=target.pw_name, LOGNAME=target.pw_name, SHELL=target.pw_shell or "/bin/bash",
               MAIL=f"/var/mail/{target.pw_name}", PATH=SECURE_PATH, SUDO_USER=caller_name, SUDO_UID=str(caller),
               SUDO_GID=str(caller_gid), SUDO_COMMAND=" ".join(argv)[:4096])
    return env


def _peer_uid(connection: socket.socket) -> int:
    creds = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    return int.from_bytes(creds[4:8], sys.byteorder)


def _receive_request(connection: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The request (one JSON line) and the caller's three standard streams sent with its first bytes."""
    data, fds, _, _ = socket.recv_fds(connection, 65536, 3)
    try:
        while not data.endswith(b"\n"):
            if len(data) > MAX_REQUEST_BYTES:
                raise ValueError("request too large")
            more = connection.recv(65536)
            if not more:
                raise ValueError("incomplete request")
            data += more
        if len(fds) != 3:
            raise ValueError(f"expected the caller's 3 standard streams, got {len(fds)}")
        request = json.loads(data)
        if not isinstance(request, dict):
            raise ValueError("malformed request")
    except (ValueError, OSError):
        for fd in fds:
            os.close(fd)
        raise
    return request, fds


def _send(connection: socket.socket, message: dict[str, Any]) -> None:
    connection.sendall(json.dumps(message).encode() + b"\n")


def _receive_line(connection: socket.socket) -> bytes:
    """One message (a JSON line) of a peer that sends one at a time and waits for the answer."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(65536)
        if not chunk:
            raise ConnectionError("the other end closed the connection")
        data += chunk
    return data


# ---- the action server's channel ----------------------------------------------------------------

class BrokerChannel:
    """The action server's end of the socket pair init made before it became the server (the
    broker holds the other): how the server, running as `user`, has root's processes ended."""

    def __init__(self, fd: int) -> None:
        self._socket = socket.socket(fileno=fd)
        self._socket.set_inheritable(False)  # no program the server starts may hold it
        self._lock = threading.Lock()

    def end_all_but(self, keep: set[int], deadline_s: float) -> int:
        """Have the broker end every process of the sandbox but `keep` (processes.end_all_but, as
        root); how many it ended. RuntimeError when some survived; OSError when the broker is
        gone or did not answer (the channel is then closed: a late answer would be misread)."""
        with self._lock:
            try:
                self._socket.settimeout(deadline_s + 30)
                _send(self._socket, {"end": sorted(keep), "deadline_s": deadline_s})
                answer = json.loads(_receive_line(self._socket))
            except OSError:
                self._socket.close()
                raise
        if "error" in answer:
            raise RuntimeError(f"the root broker: {answer['error']}")
        return int(answer["ended"])


# ---- client -------------------------------------------------------------------------------------

def client(argv: list[str], user: str, login: bool, shell: bool, keep_env: bool, password: str) -> int:
    """Ask the broker to run `argv`; the command's exit status (1 and sudo's message when refused)."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(BROKER_SOCKET)
    except OSError as e:
        print(f"sudo: the sandbox's root is not available ({e})", file=sys.stderr)
        return 1
    request = {"argv": argv, "user": user, "login": login, "shell": shell, "keep_env": keep_env,
               "password": password, "cwd": _cwd(), "env": dict(os.environ)}
    socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], [0, 1, 2])

    def forward(number: int, _frame: Any) -> None:
        try:
            connection.sendall(json.dumps({"signal": number}).encode() + b"\n")
        except OSError:
            pass

    for number in FORWARDED_SIGNALS:
        signal.signal(number, forward)
    answer = b""
    while not answer.endswith(b"\n"):
        chunk = connection.recv(65536)
        if not chunk:
            print("sudo: the sandbox's root went away", file=sys.stderr)
            return 1
        answer += chunk
    reply = json.loads(answer)
    if reply.get("error"):
        print(reply["error"], file=sys.stderr)
    return int(reply.get("exit", 1))


def _cwd() -> str:
    try:
        return os.getcwd()
    except OSError:
        return "/"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="role", required=True)
    start = sub.add_parser("init")
    start.add_argument("--grant-fd", type=int, required=True)
    start.add_argument("--limits", required=True, help="JSON: confinement.Limits fields")
    start.add_argument("--home", required=True)
    start.add_argument("--host-pid-namespace", required=True, help="the host's PID namespace (processes.py)")
    start.add_argument("server", nargs=argparse.REMAINDER, help="-- the action server's command")
    ask = sub.add_parser("client")
    ask.add_argument("--user", default="root")
    ask.add_argument("--login", action="store_true")
    ask.add_argument("--shell", action="store_true")
    ask.add_argument("--keep-env", action="store_true")
    ask.add_argument("--password-fd", type=int, default=3)
    ask.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.role == "init":
        server = args.server[1:] if args.server[:1] == ["--"] else args.server
        init(args.grant_fd, json.loads(args.limits), args.home, server, args.host_pid_namespace)
        return 1
    try:
        with os.fdopen(args.password_fd, "r", errors="replace") as secret:
            password = secret.readline().rstrip("\n")
    except OSError:  # not started by the shim: no password
        password = ""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return client(command, args.user, args.login, args.shell, args.keep_env, password)


if __name__ == "__main__":
    sys.exit(main())
