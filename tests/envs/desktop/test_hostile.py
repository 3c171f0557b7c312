"""The desktop sandbox against a hostile agent ("the desktop sandbox is a security boundary").

The agent is model output: whatever it can type into the terminal, save from the editor or click on
the desktop is tried here, through `env.step` with GUI actions where the attack is reachable that
way (attack scripts are placed in the sandbox's home through the trusted API to keep typing short;
the agent could type them, and running them is always typed). Each test asserts that nothing
leaked, that the host is untouched, and that the environment still resets and scores correctly
after. Each finding of the sandbox's security review has a test here that fails on the sandbox
as it was then (`--ro-bind / /`, the host environment, the socket in the sandbox's /tmp, actions
run from the home directory, no seccomp, no limits, a one-pass reset).
"""
from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from arpo_lib.actions import Action
from arpo_lib.envs import make_env
from arpo_lib.envs.base import EnvError
from arpo_lib.envs.desktop.scripted import solution_actions
from desktop_sandbox import confinement, gnome, runtime
from desktop_sandbox.sandbox import AGENT_UIDS, Sandbox, desktop_unavailable

REASON = desktop_unavailable()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.slow]
SCREEN = (1280, 800)
REPO = Path(__file__).resolve().parents[3]
AS_ROOT = os.geteuid() == 0


# ---- helpers -----------------------------------------------------------------------------------

DESKTOPS = ["openbox", pytest.param("gnome", marks=pytest.mark.skipif(
    gnome.unavailable() is not None, reason=gnome.unavailable() or ""))]
"""Every attack through the terminal runs on both desktops: our own (openbox) and OSWorld's
computer (GNOME Shell, its session's buses and daemons, desktop_sandbox/gnome.py)."""
GNOME_LONG = pytest.mark.long_variants("gnome")
"""On an attack whose mechanism is the sandbox's, not the desktop's (the same mounts, namespaces,
seccomp filter and reset on both), the GNOME variant runs under ARPO_LONG_TESTS=1 and the openbox
one in CI; host files, host sockets and what GNOME adds run on GNOME in CI too."""


@pytest.fixture(scope="module", params=DESKTOPS)
def terminal(request):
    """desktop/terminal-mkdir: a shell in a terminal, the agent's most direct tool."""
    env = make_env("desktop/terminal-mkdir", screen=SCREEN, max_steps=500, desktop=request.param)
    yield env
    env.close()


def put_file(env, path: str, content: str) -> None:
    """Place a file in the sandbox through the trusted API (what the agent could type itself)."""
    encoded = base64.b64encode(content.encode()).decode()
    done = env.sandbox.execute(["sh", "-c", 'printf %s "$1" | base64 -d > "$2"', "sh", encoded, path])
    assert done["returncode"] == 0, done


def typed(env, command: str, timeout: float = 60.0) -> str:
    """Type `command` into the terminal as the agent would (one `type` action ending in Enter) and
    return what it printed (the shell writes it to a file; the host reads it through the server)."""
    marker = uuid.uuid4().hex[:8]
    _, _, _, _, info = env.step(Action(kind="type", text=f"({command}) > ~/.o{marker} 2>&1; touch ~/.d{marker}\n"))
    assert info["action_error"] is None, info
    deadline = time.monotonic() + timeout
    while env.sandbox.read_file(f"~/.d{marker}") is None:
        assert time.monotonic() < deadline, f"the typed command did not finish within {timeout} s: {command}"
        time.sleep(0.2)
    return (env.sandbox.read_file(f"~/.o{marker}") or b"").decode(errors="replace")


def still_scores(env, task: str = "terminal-mkdir") -> None:
    """After an attack: a fresh episode starts and the scripted solution scores 1."""
    obs, _ = env.reset()
    reward, terminated = 0.0, False
    for action in solution_actions(task, obs.screenshot.size):
        obs, reward, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            break
    assert terminated and reward == 1.0, f"{task} no longer scores after the attack: {reward}"


def sandbox_processes(box) -> list[str]:
    return box.execute(["ps", "-eo", "comm="])["output"].split()


DESKTOP_PROCESSES = {"bwrap", "python", "python3", f"python{sys.version_info.major}.{sys.version_info.minor}", "Xvfb", "openbox", "ps", "dbus-daemon", "at-spi-bus-laun"}
"""What runs in a sandbox with no application: the server, the X server, the window manager, the
episode's session bus and AT-SPI's (a11y.py, where the tree is served), and the `ps` asking."""
GNOME_PROCESSES = {"gnome-shell", "gsd-xsettings", "gsd-media-keys", "gvfsd", "gvfsd-trash", "gvfsd-metadata",
                   "dconf-service", "at-spi2-registr", "nautilus", "xkbcomp", "pulseaudio", "sh"}
"""... and with GNOME: its session (started anew at every reset, its sound server included), and Nautilus, which the dock
starts as the file manager service."""


def desktop_processes(env) -> set[str]:
    return DESKTOP_PROCESSES | (GNOME_PROCESSES if getattr(env, "desktop", "openbox") == "gnome" else set())


# ---- 1. host files ------------------------------------------------------------------------------

@pytest.fixture
def canaries(tmp_path):
    """Secrets outside the sandbox: root-only (0600) in /etc, in /var/lib and in /usr/local/share (a
    tree the sandbox shows: only the file's owner and mode keep it out), world-readable in the
    repository, in /var/tmp and in a directory under /srv."""
    secret = uuid.uuid4().hex
    made = []
    places = [(f"/etc/arpo-canary-{secret[:8]}", 0o600), (f"/var/lib/arpo-canary-{secret[:8]}", 0o600),
              (f"/usr/local/share/arpo-canary-{secret[:8]}", 0o600),
              (str(REPO / f".arpo-canary-{secret[:8]}"), 0o644), (f"/var/tmp/arpo-canary-{secret[:8]}", 0o644),
              (f"/srv/arpo-canary-{secret[:8]}/secret", 0o644)]
    for path, mode in places:
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(f"canary {secret}\n")
            os.chmod(path, mode)
            made.append(path)
        except OSError:
            continue
    assert len(made) >= 2, "could not place the canaries"
    yield secret, made
    for path in made:
        Path(path).unlink(missing_ok=True)
    subprocess.run(["rm", "-rf", f"/srv/arpo-canary-{secret[:8]}"])


def test_finding1_no_host_file_is_readable(terminal, canaries):
    secret, paths = canaries
    terminal.reset()
    out = typed(terminal, f"cat {' '.join(paths)}; ls -a {REPO}; ls -a /root /var/lib /srv /home; "
                          f"grep -rs {secret} /etc /var /srv /opt /home")  # not the Python trees: gigabytes
    assert secret not in out, f"a host file leaked into the sandbox:\n{out[-2000:]}"
    assert typed(terminal, f"test -e {REPO} && echo there || echo absent").strip() == "absent"  # nor its package:
    # the sandbox's copy of it is at /opt/arpo/lib
    assert typed(terminal, "ls /opt/arpo/lib").split() == ["desktop_sandbox"]
    assert typed(terminal, "cat /etc/shadow /etc/gshadow 2>/dev/null | wc -c").strip() == "0"
    still_scores(terminal)


@GNOME_LONG
@pytest.mark.skipif(not AS_ROOT, reason="started by an ordinary user, the sandbox's user is that user")
def test_started_by_root_the_sandboxs_user_is_no_one_on_the_host(terminal, canaries):
    """Started by root, the sandbox's user maps to an unprivileged uid of its own (its staged Python
    is world-readable): a root-only file in a tree the sandbox shows (/usr) is refused by its
    permissions, and the kernel's process limit applies. Before, the check of what that uid could
    read ran while the work directory (the package copy the sandbox binds) was still 0700, and the
    user mapped to the host's root: the file was read by owner match."""
    secret, paths = canaries
    terminal.reset()
    report = terminal.sandbox.report()
    assert report["host_uid"] in AGENT_UIDS and "maps to root" not in terminal.sandbox.describe(), report
    bound = next(p for p in paths if p.startswith("/usr/"))
    out = typed(terminal, f"cat {bound}; id -u; ulimit -u")
    assert secret not in out and "Permission denied" in out, out
    assert out.split()[-2] == "1000" and out.split()[-1] != "unlimited", out
    assert oct(terminal.sandbox.workdir.joinpath("control").stat().st_mode & 0o777) == "0o700"


WRITE_THROUGH_PID_1 = "m={head}; for fd in 1 2; do echo \"$m{tail}\" >> /proc/1/fd/$fd; echo rc=$?; done; ls -l /proc/1/fd/"
"""The sandbox's program appends to PID 1's standard output and error (the marker in two halves:
only what reaches PID 1's output holds it whole)."""


def _host_files(workdir: Path) -> dict[str, int]:
    return {str(p): p.stat().st_size for p in workdir.rglob("*") if p.is_file()}


def _nothing_written_to_the_host(workdir: Path, before: dict[str, int], marker: str, out: str) -> None:
    grew = {p: (before.get(p), size) for p, size in _host_files(workdir).items() if before.get(p) != size}
    assert grew == {}, f"the host's files changed: {grew}\n{out}"
    holding = subprocess.run(["grep", "-rl", marker, str(workdir)], capture_output=True, text=True).stdout
    assert holding == "", f"written to the host through PID 1's output: {holding}"
    assert str(workdir) not in out, out  # PID 1 holds no file of the host


@GNOME_LONG
def test_the_agent_cannot_write_to_the_host_through_pid_1s_output(terminal, tmp_path):
    """PID 1 inside (bubblewrap) holds the sandbox's standard output and error. Before, they were
    the host's `<workdir>/control/server.log`, and `echo x >> /proc/1/fd/1` typed into the terminal
    appended to it (bounded only by limits.file_mib). Now they are a pipe whose tail the host keeps
    in memory: whatever is written there changes no file of the host. Typed into the terminal, and
    run in a sandbox whose user maps to the host's root (a bind only root may read keeps it so),
    where PID 1's descriptors are open to the agent."""
    terminal.reset()
    marker = uuid.uuid4().hex
    before = _host_files(terminal.sandbox.workdir)
    out = typed(terminal, WRITE_THROUGH_PID_1.format(head=marker[:16], tail=marker[16:]))
    _nothing_written_to_the_host(terminal.sandbox.workdir, before, marker, out)
    assert terminal.sandbox.get_json("/health")["ok"] is True
    if AS_ROOT:
        private = tmp_path / "private"  # pytest's directory: root's alone (0700)
        private.mkdir()
        with Sandbox(SCREEN, binds={str(private): "/opt/private"}) as box:
            assert box.report()["host_uid"] is None, box.describe()
            before = _host_files(box.workdir)
            done = box.execute(WRITE_THROUGH_PID_1.format(head=marker[:16], tail=marker[16:]), shell=True)
            assert done["output"].count("rc=0") == 2 and "pipe:" in done["output"], done  # written: into the pipe
            _nothing_written_to_the_host(box.workdir, before, marker, done["output"] + done["error"])
            assert box.get_json("/health")["ok"] is True
    still_scores(terminal)


def _host_paths() -> list[str]:
    """Paths that would tell the agent the host's layout: the checkout, the environments, the home."""
    paths = {str(REPO), sys.prefix, sys.base_prefix, str(Path(sys.base_prefix).resolve()), os.path.expanduser("~"),
             os.path.realpath(sys.prefix)}
    return sorted(p for p in paths if p not in ("/", "/usr", "/usr/local"))


@GNOME_LONG
def test_the_agent_sees_no_host_path_in_pid_1_the_mounts_or_the_shims(terminal):
    """PID 1 inside is bubblewrap: its command line and environment, every process's command line,
    the mount table and the trusted shims the agent can read name no host directory (the checkout,
    the virtual environment, the interpreter's installation, the home)."""
    terminal.reset()
    out = typed(terminal, "tr '\\0' ' ' < /proc/1/cmdline; echo; tr '\\0' ' ' < /proc/1/environ; echo; "
                          "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done; "
                          "cat /proc/self/mountinfo /proc/self/mounts; cat /opt/arpo/bin/python /opt/arpo/bin/python3")
    assert "bwrap --args" in out and ("/opt/arpo/python" in out or "/usr/bin/python" in out), out[-3000:]
    leaked = [p for p in _host_paths() if p in out]
    assert not leaked, f"host paths visible inside: {leaked}\n{out[-3000:]}"
    assert "PATH=/usr/local/bin:/usr/bin:/bin" in out  # bubblewrap's own environment: the sandbox's PATH


# ---- 2. the host environment --------------------------------------------------------------------

def test_finding2_the_host_environment_is_not_passed_in(monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("ARPO_CANARY_TOKEN", secret)
    monkeypatch.setenv("WANDB_API_KEY", secret)
    env = make_env("desktop/terminal-mkdir", screen=SCREEN, max_steps=50)
    try:
        env.reset()
        out = typed(env, "env; cat /proc/[0-9]*/environ | tr '\\0' '\\n'")
        assert secret not in out and "ARPO_CANARY_TOKEN" not in out and "WANDB" not in out
        assert "HOME=/home/user" in out
        still_scores(env)
    finally:
        env.close()


# ---- 3. host sockets ----------------------------------------------------------------------------

def test_finding3_no_host_unix_socket_answers(terminal, tmp_path):
    name = uuid.uuid4().hex[:8]
    directory = Path(f"/var/tmp/arpo-sock-{name}")
    directory.mkdir()
    directory.chmod(0o755)
    paths = [str(directory / "s")]
    listeners = []
    for address in (paths[0], f"\0arpo-canary-{name}"):  # a filesystem socket and an abstract one
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen(4)
        listener.settimeout(0.2)
        listeners.append(listener)
    os.chmod(paths[0], 0o777)
    connections: list[str] = []
    stop = threading.Event()

    def accept(listener):
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
                connections.append(str(listener.getsockname()))
                connection.close()
            except OSError:
                continue

    threads = [threading.Thread(target=accept, args=(s,), daemon=True) for s in listeners]
    for thread in threads:
        thread.start()
    try:
        terminal.reset()
        put_file(terminal, "/home/user/probe.py", textwrap.dedent(f"""\
            import socket
            for address in ({paths[0]!r}, '\\0arpo-canary-{name}'):
                c = socket.socket(socket.AF_UNIX)
                try:
                    c.connect(address)
                    print('CONNECTED', address)
                except OSError as e:
                    print('refused', e)
            """))
        out = typed(terminal, "python3 ~/probe.py")
        assert "refused" in out and "CONNECTED" not in out, out
        assert connections == []
        still_scores(terminal)
    finally:
        stop.set()
        for listener in listeners:
            listener.close()
        subprocess.run(["rm", "-rf", str(directory)])


# ---- 4. shadowing the action interpreter ---------------------------------------------------------

def test_finding4_a_saved_pyautogui_py_does_not_run(tmp_path):
    """In the editor, the agent types Python, saves it as pyautogui.py with Save As (and the terminal
    plants the same module where an interpreter could look: /tmp, the user site, sitecustomize);
    the next click must run pyautogui, not that file."""
    env = make_env("desktop/editor-type-save", screen=SCREEN, max_steps=60)
    try:
        env.reset()
        payload = "open('/home/user/pwned', 'w').write('shadowed')"
        env.step(Action(kind="type", text=payload))
        env.step(Action(kind="hotkey", keys=["ctrl", "shift", "s"]))
        env.step(Action(kind="wait"))
        env.step(Action(kind="hotkey", keys=["ctrl", "a"]))
        env.step(Action(kind="type", text="/home/user/pyautogui.py\n"))
        env.step(Action(kind="wait"))
        assert env.sandbox.read_file("~/pyautogui.py") == payload.encode(), "the editor did not save the file"
        for place in ("/tmp/pyautogui.py", "/home/user/sitecustomize.py", "/home/user/usercustomize.py",
                      "/tmp/sitecustomize.py", "/home/user/.local/lib/python3.11/site-packages/pyautogui.py",
                      "/home/user/Desktop/pyautogui.py"):
            env.sandbox.execute(["sh", "-c", f'mkdir -p "$(dirname {place})" && cp ~/pyautogui.py {place}'])
        _, _, _, _, info = env.step(Action(kind="click", point=(5, 5)))
        assert info["action_error"] is None, info
        env.step(Action(kind="type", text="x"))
        assert env.sandbox.read_file("~/pwned") is None, "an action ran the agent's file"
        # trusted commands too (OSWorld's set-up and checkers run `python -c "import pyautogui"` in the home)
        env.sandbox.execute(["sh", "-c", "cp ~/pyautogui.py ~/json.py"])
        done = env.sandbox.execute(["python3", "-c", "import json, pyautogui"])
        assert env.sandbox.read_file("~/pwned") is None, f"a trusted command ran the agent's file: {done}"
        still_scores(env, "editor-type-save")
    finally:
        env.close()


# ---- 5. the control API ------------------------------------------------------------------------

PROBE_SOCKETS = textwrap.dedent("""\
    import ctypes, os, socket, stat, sys
    found = []
    for top in sys.argv[1:] or ['/']:
        for root, dirs, files in os.walk(top):
            if root in ('/proc', '/sys', '/usr', '/dev'):
                dirs[:] = []
                continue
            for name in files + dirs:
                path = os.path.join(root, name)
                try:
                    if stat.S_ISSOCK(os.lstat(path).st_mode):
                        found.append(path)
                except OSError:
                    pass
    print('sockets', found)
    for path in found:
        c = socket.socket(socket.AF_UNIX)
        c.settimeout(3)
        try:
            c.connect(path)
            c.sendall(b'GET /health HTTP/1.0\\r\\n\\r\\n')
            print('answer', path, c.recv(300))
        except OSError as e:
            print('no answer', path, e)
    libc = ctypes.CDLL(None, use_errno=True)
    for pid in sorted(int(p) for p in os.listdir('/proc') if p.isdigit()):
        if pid == os.getpid():
            continue
        try:
            fds = os.listdir(f'/proc/{pid}/fd')
        except OSError as e:
            fds = []
        for fd in fds:
            try:
                print('LINK', pid, fd, os.readlink(f'/proc/{pid}/fd/{fd}'))
                os.close(os.open(f'/proc/{pid}/fd/{fd}', os.O_RDONLY))
                print('OPENED', pid, fd)
            except OSError:
                pass
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue
        for fd in range(3, 12):
            if libc.syscall(438, pidfd, fd, 0) >= 0:  # pidfd_getfd
                print('STOLE', pid, fd)
    """)


@GNOME_LONG
def test_finding4_the_trusted_commands_shims_cannot_be_replaced_from_the_terminal(terminal):
    """OSWorld's set-up steps and getters run `python`, `sudo` and `google-chrome` by name: typed into
    the terminal, the agent tries to overwrite them, to put its own earlier on the PATH, and to
    shadow pyautogui; a trusted command afterwards still runs the workbench's."""
    terminal.reset()
    out = typed(terminal, "for n in python python3 sudo chrome google-chrome; do echo 'echo owned' > /opt/arpo/bin/$n; done; "
                          "rm -f /opt/arpo/bin/sudo; mv /opt/arpo/bin/python /tmp/p; ln -sf /bin/true /opt/arpo/bin/python3; "
                          "mkdir -p ~/bin ~/.local/bin; for d in ~/bin ~/.local/bin /tmp; do "
                          "printf '#!/bin/sh\\necho owned\\n' > $d/python; printf '#!/bin/sh\\necho owned\\n' > $d/sudo; "
                          "chmod +x $d/python $d/sudo; done; echo 'raise SystemExit(\"owned\")' > ~/pyautogui.py; "
                          "echo 'export PATH=~/bin:$PATH' >> ~/.bashrc; echo 'export PATH=~/bin:$PATH' >> ~/.profile; ls /opt/arpo/bin")
    assert out.count("Read-only file system") >= 5, out
    box = terminal.sandbox
    inside = runtime.stage(tuple(confinement.site_directories())).python  # the sandbox's interpreter
    probe = box.execute(["python", "-c", "import pyautogui, sys; print(sys.executable == %r, pyautogui.__file__.startswith('/home'))"
                         % inside])
    assert probe["output"] == "True False\n", probe
    sudo = box.execute("echo password | sudo -S echo fine; echo password | sudo -S python3 -c 'print(2 + 2)'", shell=True)
    assert sudo["output"] == "fine\n4\n", sudo
    assert box.execute(["sh", "-c", "for n in python sudo google-chrome; do command -v $n; done"])["output"].split() == [
        "/opt/arpo/bin/python", "/opt/arpo/bin/sudo", "/opt/arpo/bin/google-chrome"]


@GNOME_LONG
def test_finding5_the_control_api_is_out_of_reach(terminal):
    terminal.reset()
    put_file(terminal, "/home/user/probe.py", PROBE_SOCKETS)
    out = typed(terminal, "python3 ~/probe.py")
    assert "sockets" in out and '"ok": true' not in out and "HTTP/1" not in out and "STOLE" not in out, out
    server = [line for line in out.splitlines() if line.startswith(("LINK 2 ", "OPENED 2 "))]  # the server is pid 2
    assert server == [], server  # its descriptors (the listening socket among them) are not reachable
    still_scores(terminal)


def test_finding5_one_sandbox_cannot_reach_another(monkeypatch):
    """With TMPDIR outside /tmp, /run and /home, the old sandbox saw the other's work directory."""
    base = Path(f"/var/lib/arpo-tmp-{uuid.uuid4().hex[:8]}") if AS_ROOT else Path.home() / f"arpo-tmp-{uuid.uuid4().hex[:8]}"
    base.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    env = make_env("desktop/terminal-mkdir", screen=SCREEN, max_steps=50)
    try:
        with Sandbox(SCREEN) as other:
            other.execute("echo other-secret > ~/mine.txt", shell=True)
            env.reset()
            put_file(env, "/home/user/probe.py", PROBE_SOCKETS)
            out = typed(env, f"ls -la {base} {other.workdir}; cat {other.workdir}/*/mine.txt; python3 ~/probe.py {base} /")
            assert "other-secret" not in out and '"ok": true' not in out, out
            assert f"ls: cannot access '{base}'" in out and f"ls: cannot access '{other.workdir}'" in out, out
            assert other.read_file("~/mine.txt") == b"other-secret\n"
        still_scores(env)
    finally:
        env.close()
        subprocess.run(["rm", "-rf", str(base)])


# ---- 6. a shell in every task --------------------------------------------------------------------

def test_finding6_no_desktop_menu_or_binding_starts_a_program():
    """A right click (and a middle click) on the desktop opened openbox's root menu, whose first
    entry is a terminal; Enter picked it. Nothing may appear or start now."""
    env = make_env("desktop/editor-type-save", screen=SCREEN, max_steps=60)
    try:
        env.reset()
        before = sorted(sandbox_processes(env.sandbox))
        corner = (15, SCREEN[1] - 15)  # the bare desktop: Mousepad's window is centred
        region = (0, SCREEN[1] - 300, 300, SCREEN[1])
        obs, *_ = env.step(Action(kind="wait"))
        shot = obs.screenshot.crop(region).tobytes()
        for click in ("right_single", "click"):
            obs, *_ = env.step(Action(kind=click, point=corner))
            if click == "right_single":
                assert obs.screenshot.crop(region).tobytes() == shot, "a menu opened on the desktop"
            for keys in (["down"], ["enter"], ["super", "e"], ["alt", "f2"], ["ctrl", "alt", "t"]):
                env.step(Action(kind="hotkey", keys=keys))
        env.sandbox.post_json("/run_action", {"code": f"import pyautogui\npyautogui.click({corner[0]}, {corner[1]}, "
                                                       "button='middle')\npyautogui.press('enter')"})
        time.sleep(1.0)
        after = sorted(sandbox_processes(env.sandbox))
        assert after == before, f"a program started: {sorted(set(after) - set(before))}"
        still_scores(env, "editor-type-save")
    finally:
        env.close()


# ---- 7. seccomp, nested namespaces, limits --------------------------------------------------------

PROBE_SYSCALLS = textwrap.dedent("""\
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    calls = {'unshare(NEWUSER)': (272, 0x10000000), 'unshare(NEWNS)': (272, 0x00020000), 'setns': (308, 0, 0),
             'mount': (165, 0, 0, 0, 0, 0), 'ptrace(ATTACH 2)': (101, 16, 2, 0, 0), 'bpf': (321, 0, 0, 0),
             'keyctl(session)': (250, 0, -3, 0), 'add_key': (248, 0, 0, 0, 0, 0),
             'perf_event_open': (298, 0, 0, -1, -1, 0), 'io_uring_setup': (425, 1, 0), 'userfaultfd': (323, 0),
             'init_module': (175, 0, 0, 0), 'kexec_load': (246, 0, 0, 0, 0), 'reboot': (169, 0, 0, 0, 0),
             'process_vm_readv': (310, 2, 0, 0, 0, 0, 0), 'pidfd_getfd': (438, 0, 0, 0), 'swapon': (167, 0, 0),
             'clone(NEWUSER)': (56, 0x10000000 | 17, 0, 0, 0, 0), 'clone3': (435, 0, 0),
             'ioctl(TIOCSTI)': (16, 0, 0x5412, 0)}
    for name, (number, *args) in calls.items():
        result = libc.syscall(number, *[ctypes.c_long(a) for a in args])
        if result == 0 and name.startswith('clone'):
            os._exit(0)  # the child of a clone that went through
        print(name, 'returned', result, 'errno', ctypes.get_errno())
    """)


@GNOME_LONG
def test_finding7_no_nested_namespaces_and_the_kernel_surface_is_filtered(terminal):
    terminal.reset()
    out = typed(terminal, "unshare -Ur id; unshare -m id; unshare -p -f id; echo; grep Cap /proc/self/status")
    assert "uid=0" not in out and "Operation not permitted" in out, out
    put_file(terminal, "/home/user/probe.py", PROBE_SYSCALLS)
    out = typed(terminal, "python3 ~/probe.py")
    results = dict(line.split(" returned ") for line in out.splitlines() if " returned " in line)
    assert len(results) == 20, out
    for name, result in results.items():
        expected = "errno 38" if name == "clone3" else "errno 1"
        assert result.startswith("-1 ") and result.endswith(expected), f"{name}: {result}"
    still_scores(terminal)


def _host_tasks() -> int:
    total = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                total += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:
                pass
    return total


def _wait_for_incident(box, timeout: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        incidents = box.get_json("/health", timeout=30)["incidents"]
        if incidents:
            return incidents
        time.sleep(0.3)
    return []


def _kernel_bounds_processes(box) -> bool:
    """Whether the kernel itself limits the sandbox's processes: a cgroup, or RLIMIT_NPROC (which
    applies unless the sandbox's user maps to root)."""
    report = box.report()
    return report["cgroup"] is not None or report["host_uid"] is not None or os.geteuid() != 0


def test_finding7_a_fork_bomb_ends_its_own_episode_not_the_machine():
    pids = 256
    env = make_env("desktop/terminal-mkdir", screen=SCREEN, max_steps=50, limits={"pids": pids})
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _host_tasks())
            time.sleep(0.05)

    try:
        env.reset()
        baseline = _host_tasks()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        env.step(Action(kind="type", text="b(){ b|b& };b\n"))
        incidents = _wait_for_incident(env.sandbox)
        time.sleep(1.0)
        stop.set()
        sampler.join()
        assert incidents and incidents[0].startswith("pids limit"), incidents
        # Bounded by the limit plus what the bomb forks between two counts of the watcher (50 ms: ~2,000
        # here); where the kernel applies RLIMIT_NPROC (not for a sandbox whose user maps to root) by the limit.
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
        assert peak[0] - baseline < pids + 5000 and peak[0] < pid_max // 2, f"the bomb reached {peak[0] - baseline} tasks"
        if _kernel_bounds_processes(env.sandbox):
            assert peak[0] - baseline < pids + 200, f"the kernel's limit let {peak[0] - baseline} tasks through"
        assert set(sandbox_processes(env.sandbox)) <= DESKTOP_PROCESSES | {"sh"}
        still_scores(env)
    finally:
        stop.set()
        env.close()


def test_finding7_memory_is_bounded_per_process_and_in_total():
    env = make_env("desktop/terminal-mkdir", screen=SCREEN, max_steps=50,
                   limits={"memory_mib": 512, "total_memory_mib": 700})
    try:
        env.reset()
        out = typed(env, "python3 -c 'b = bytearray(1024 * 2**20); print(\"ALLOCATED\")'")
        assert "MemoryError" in out and "ALLOCATED" not in out, out
        env.step(Action(kind="type", text="for i in 1 2 3; do python3 -c 'import time; b = b\"x\" * (300 * 2**20); "
                                           "time.sleep(60)' & done\n"))
        incidents = _wait_for_incident(env.sandbox)
        assert incidents and incidents[0].startswith("memory limit"), incidents
        assert "python3" not in sandbox_processes(env.sandbox)
        still_scores(env)
    finally:
        env.close()


def test_finding7_disk_and_file_size_are_bounded_and_nothing_lands_on_the_host():
    env = make_env("desktop/terminal-mkdir", screen=SCREEN, max_steps=50,
                   limits={"home_mib": 32, "scratch_mib": 16, "file_mib": 24})
    try:
        env.reset()
        out = typed(env, "for d in ~ ~ /tmp /var/tmp /dev/shm /run; do dd if=/dev/zero of=$d/fill$RANDOM bs=1M count=20; "
                         "done; df -m ~ /tmp; rm -f ~/fill*; dd if=/dev/zero of=~/big bs=1M count=30; stat -c %s ~/big")
        assert out.count("No space left on device") == 5, out  # the home's second file, and each scratch directory
        assert out.split()[-1] == str(24 * 2**20), out  # the 30 MiB file stopped at the 24 MiB file-size limit
        usage = subprocess.run(["du", "-sm", str(env.sandbox.workdir)], capture_output=True, text=True).stdout
        assert int(usage.split()[0]) < 5, f"the agent's writes landed on the host: {usage}"
        still_scores(env)
    finally:
        env.close()


def test_an_action_process_has_a_cpu_time_limit():
    """An action's interpreter gets RLIMIT_CPU (what the whitelist lets through cannot spin, so the
    mechanism is checked on the command the server builds, with a spinning body)."""
    from desktop_sandbox.processes import action_command

    command = action_command(sys.executable, "x = 0\nwhile True:\n    x += 1", cpu_s=1, python_path=[], preamble="")
    done = subprocess.run(command, capture_output=True, timeout=60)
    assert done.returncode == -signal.SIGXCPU or done.returncode == -signal.SIGKILL, done


# ---- 8. the server under abuse -------------------------------------------------------------------

def _raw(box, payload: bytes) -> bytes:
    connection = socket.socket(socket.AF_UNIX)
    connection.settimeout(30)
    connection.connect(box.socket_path)
    connection.sendall(payload)
    data = connection.recv(4096)
    connection.close()
    return data


def _held_inputs(box) -> int:
    code = ("from Xlib.display import Display; d = Display(); "
            "print(sum(bin(b).count('1') for b in d.query_keymap()) + bin(d.screen().root.query_pointer().mask & 0x1f00).count('1'))")
    done = box.execute(["python3", "-c", code])  # the sandbox's interpreter, through its shim
    assert done["returncode"] == 0, done
    return int(done["output"])


def test_finding8_every_malformed_or_abusive_request_is_a_json_error():
    env = make_env("desktop/terminal-mkdir", screen=SCREEN, max_steps=50)
    try:
        env.reset()
        box = env.sandbox
        refused = {
            "lone surrogate": "\ud800",
            "deep unary minus": "-" * 100_000,
            "200,000 statements": "pyautogui.click(1, 1)\n" * 200_000,
            "a sleep of 1e9 s": "import time\ntime.sleep(1e9)",
            "a million clicks": "import pyautogui\npyautogui.click(5, 5, clicks=1000000)",
            "a scroll point off screen": "import pyautogui\npyautogui.scroll(5, 99999, 99999)",
            "a hundred thousand presses": "import pyautogui\npyautogui.press('a', presses=100000)",
            "typing for 1000 s": "import pyautogui\npyautogui.write('" + "a" * 1000 + "', interval=1.0)",
            "a drag of an hour": "import pyautogui\npyautogui.dragTo(5, 5, duration=3600)",
            "an unknown keyword": "import pyautogui\npyautogui.click(5, 5, _pause=False)",
            "not a string": 12,
        }
        for why, code in refused.items():
            status, data = box.request("POST", "/run_action", {"code": code}, timeout=30)
            answer = json.loads(data)
            assert status == 403 and answer["status"] == "refused", (why, status, data[:200])
        for payload, status in [(b"not json", 400), (b"[1, 2]", 400), (b'{"code": ' + b"[" * 100_000 + b"]}", 400)]:
            got, data = box.request("POST", "/run_action", payload, headers={"Content-Type": "application/json"})
            assert got == status and "error" in json.loads(data), (payload[:20], got, data[:200])
        got, data = box.request("POST", "/run_action", b"{" + b" " * (9 * 2**20) + b"}")
        assert got == 413, (got, data[:200])
        for body, status in [({"command": 5}, 400), ({"command": ["ls"], "timeout": "x"}, 400), ({}, 400)]:
            got, data = box.request("POST", "/execute", body)
            assert got == status and "error" in json.loads(data), (body, got, data)
        assert box.request("POST", "/file", {"file_path": 7})[0] == 400
        assert box.request("GET", "/nope")[0] == 404
        assert b" 400 " in _raw(box, b"POST /execute HTTP/1.1\r\nContent-Length: abc\r\n\r\n")
        # held keys and buttons do not outlive the action that pressed them
        assert box.run_action("import pyautogui\npyautogui.keyDown('shift')")["returncode"] == 0
        assert box.run_action("import pyautogui\npyautogui.mouseDown(button='left')")["returncode"] == 0
        assert _held_inputs(box) == 0
        assert box.get_json("/health")["ok"] is True
        still_scores(env)
    finally:
        env.close()


# ---- 9. reset and clean-up --------------------------------------------------------------------------

@GNOME_LONG
def test_finding9_a_reset_ends_every_process_even_while_they_fork(terminal):
    for trial in range(3):
        terminal.reset()
        terminal.step(Action(kind="type", text="for i in $(seq 800); do sleep 1000 & done; "
                                                "while :; do sleep 1000 & sleep 0.002; done &\n"))
        deadline = time.monotonic() + 30
        while sandbox_processes(terminal.sandbox).count("sleep") < 400:
            assert time.monotonic() < deadline, "the sleepers did not start"
            time.sleep(0.2)
        terminal.sandbox.reset_session()
        left = sandbox_processes(terminal.sandbox)
        assert set(left) <= desktop_processes(terminal) | {"sh"} and "sleep" not in left and "bash" not in left, \
            (trial, left)
    still_scores(terminal)


def test_finding9_the_work_directory_goes_when_its_owner_is_killed(tmp_path):
    script = ("import sys, time; sys.path.insert(0, %r); from desktop_sandbox.sandbox import Sandbox; "
              "box = Sandbox((640, 480)); box.launch(['sleep', '600']); print(box.workdir, flush=True); time.sleep(600)"
              % str(REPO))
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    workdir = Path(next(line.strip() for line in owner.stdout if line.startswith("/")))  # after the log line
    assert workdir.is_dir()
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 20
    while workdir.exists() or _processes_mentioning(str(workdir)):
        assert time.monotonic() < deadline, f"left behind: {workdir.exists()}, {_processes_mentioning(str(workdir))}"
        time.sleep(0.2)


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if text.encode() in Path(f"/proc/{entry.name}/cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


# ---- the modes: as an ordinary user, and the dedicated-user fallback ------------------------------

ORDINARY_USER_SCRIPT = textwrap.dedent("""\
    import json, os, sys, time
    from arpo_lib.envs import make_env
    from arpo_lib.envs.desktop.scripted import solution_actions
    env = make_env('desktop/terminal-mkdir', screen=(1280, 800))
    try:
        obs, _ = env.reset()
        for action in solution_actions('terminal-mkdir', obs.screenshot.size):
            obs, reward, terminated, truncated, info = env.step(action)
            if terminated or truncated:
                break
        env.reset()
        probe = env.sandbox.execute('cat /etc/arpo-canary-user 2>&1; ulimit -u', shell=True)  # dash: ulimit -p
        if 'Illegal option' in probe['error']:
            probe = env.sandbox.execute(['bash', '-c', 'cat /etc/arpo-canary-user 2>&1; ulimit -u'])
        print(json.dumps({'uid': os.getuid(), 'reward': reward, 'mode': env.sandbox.report()['isolation'],
                          'probe': probe['output'] + probe['error']}))
    finally:
        env.close()
    """)


SANDBOX_PACKAGES = ("PIL", "pyautogui", "pymsgbox", "pytweening", "pyscreeze", "mouseinfo", "pygetwindow", "pyrect",
                    "Xlib", "pyseccomp", "pyperclip", "six")
"""What the desktop environment imports (arpo_lib's desktop code, the server, the actions)."""


def _readable_site(where: Path) -> Path:
    """A site-packages directory any user can read, with arpo_lib, desktop_sandbox and SANDBOX_PACKAGES copied in
    (the clone and its venv may sit in a directory only root can enter, as a CI clone in a
    mktemp directory does)."""
    import glob
    import importlib.metadata as metadata
    import importlib.util
    import shutil

    site = where / "site-packages"
    site.mkdir(parents=True)
    for name in SANDBOX_PACKAGES:
        spec = importlib.util.find_spec(name)
        assert spec is not None, f"{name} is not installed"
        if spec.submodule_search_locations:
            source = Path(list(spec.submodule_search_locations)[0])
            shutil.copytree(source, site / source.name, ignore=shutil.ignore_patterns("__pycache__"))
            for libs in glob.glob(str(source.parent / "*.libs")):  # vendored shared libraries (pillow.libs)
                if Path(libs).name.lower().startswith(("pillow", name.lower())) and not (site / Path(libs).name).exists():
                    shutil.copytree(libs, site / Path(libs).name)
        else:
            shutil.copy(spec.origin, site)
    for dist in {d for name in SANDBOX_PACKAGES for d in metadata.packages_distributions().get(name, [])}:
        found = metadata.distribution(dist)  # its .dist-info: what pip leaves, and what the sandbox's stage goes by
        info = Path(str(found.locate_file(next(f for f in found.files if f.name == "METADATA")))).parent
        shutil.copytree(info, site / info.name, dirs_exist_ok=True)
    for package in ("arpo_lib", "desktop_sandbox"):
        shutil.copytree(REPO / package, site / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["chmod", "-R", "a+rX", str(where)], check=True)
    return site


@pytest.mark.skipif(not AS_ROOT or not os.access("/usr/bin/python3", os.X_OK), reason="needs root to become another user")
def test_the_sandbox_runs_as_an_ordinary_user_too():
    """The same sandbox started by an unprivileged user (nobody), with the system Python and this
    environment's packages: namespaces mode, the task scores, a root-only file stays unreadable,
    and the kernel's process limit applies (it exempts only root)."""
    check = subprocess.run(["/usr/bin/python3", "-c", "import tkinter"], capture_output=True)
    if check.returncode != 0:
        pytest.skip("the system Python has no tkinter (apt-get install python3-tk)")
    where = Path(tempfile.mkdtemp(prefix="arpo-ordinary-", dir="/tmp"))
    where.chmod(0o755)
    Path("/etc/arpo-canary-user").write_text("secret-of-root\n")
    os.chmod("/etc/arpo-canary-user", 0o600)
    try:
        site = _readable_site(where)
        script = where / "run.py"
        script.write_text(ORDINARY_USER_SCRIPT)
        script.chmod(0o644)
        done = subprocess.run(["/usr/bin/python3", str(script)], user=65534, group=65534, extra_groups=[],
                              env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": str(site)},
                              cwd="/", capture_output=True, text=True, timeout=300)
    finally:
        os.unlink("/etc/arpo-canary-user")
        subprocess.run(["rm", "-rf", str(where)])
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["uid"] == 65534 and result["mode"] == "namespaces" and result["reward"] == 1.0, result
    assert "secret-of-root" not in result["probe"] and result["probe"].split()[-1] != "unlimited", result


@pytest.mark.skipif(not AS_ROOT, reason="the dedicated-user fallback needs root")
def test_the_user_fallback_keeps_the_agent_away_from_the_host(canaries, monkeypatch):
    """Forced here (user namespaces work on this machine): applications run as a dedicated account
    with /home/user; root-only files, the host environment and the control socket stay out of
    reach; a reset ends every process of the account; the tasks score; nothing is left after."""
    secret, paths = canaries
    monkeypatch.setenv("ARPO_CANARY_TOKEN", secret)
    env = make_env("desktop/terminal-mkdir", screen=SCREEN, max_steps=80, isolation="user")
    try:
        env.reset()
        report = env.sandbox.report()
        assert report["isolation"] == "user" and report["losses"] and report["agent_uid"] is not None
        root_only = [p for p in paths if os.stat(p).st_mode & 0o077 == 0]
        out = typed(env, f"id; env; cat {' '.join(root_only)}; ls {env.sandbox.workdir}/control")
        assert secret not in out and "Permission denied" in out, out
        put_file(env, "/home/user/probe.py", PROBE_SOCKETS)
        out = typed(env, f"python3 ~/probe.py {env.sandbox.workdir} /tmp /var/tmp /run")
        assert '"ok": true' not in out, out
        if report["network_blocked"]:
            out = typed(env, "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 22), 3)\" 2>&1 | tail -1")
            assert "refused" in out or "unreachable" in out or "timed out" in out, out
        env.step(Action(kind="type", text="for i in $(seq 200); do sleep 1000 & done; "
                                          "while :; do sleep 1000 & sleep 0.002; done &\n"))
        time.sleep(2)
        env.sandbox.reset_session()
        uid = report["agent_uid"]
        left = [p for p in os.listdir("/proc") if p.isdigit() and _uid_of(p) == uid]
        assert {c for c in map(_comm, left) if c} <= DESKTOP_PROCESSES, left  # the new episode's buses at most (a11y.py)
        still_scores(env)
        workdir = env.sandbox.workdir
    finally:
        env.close()
    assert not workdir.exists() and not Path("/home/user").exists()
    assert [p for p in os.listdir("/proc") if p.isdigit() and _uid_of(p) == uid] == []


FAKE_SCORE = r"""
import os, signal, sys
# Left running by the agent: every process that starts after this one (a checker's `stat` or
# `head`, run as the agent's user) is stopped, and a success written into its output pipe.
me, seen = os.getpid(), set(os.listdir("/proc"))
open(sys.argv[1], "w").close()
while True:
    for p in os.listdir("/proc"):
        if not p.isdigit() or p in seen:
            continue
        try:
            if os.stat(f"/proc/{p}").st_uid != os.getuid():
                continue  # not ours (yet): a checker started by root becomes ours a moment later
        except OSError:
            seen.add(p)
            continue
        seen.add(p)
        try:
            os.kill(int(p), signal.SIGSTOP)
            fd = os.open(f"/proc/{p}/fd/1", os.O_WRONLY)
            os.write(fd, b"directory|755\n" * 4)
            os.close(fd)
            with open(sys.argv[1], "a") as log:
                log.write(p + "\n")
        except OSError:
            pass
        finally:
            try:
                os.kill(int(p), signal.SIGCONT)
            except OSError:
                pass
"""


@pytest.mark.parametrize("isolation", ["namespaces", "user"])
def test_a_program_left_running_cannot_fake_the_checkers_answer(isolation):
    """Before, the terminal tasks' checker ran `stat` as the agent's user: a program the agent left
    running stopped it and wrote "directory|755" into its output pipe (/proc/<pid>/fd/1), and the
    episode scored 1 without the folder (3 of 3 tries). Now the server reads the paths itself: no
    process answers for the checker, and the episode scores 0. In the `user` fallback the pipe was
    root's and refused the agent's uid already (this test passed there before), but the `stat` and
    `head` run for checkers could still be stopped, killed or, where Yama allows, ptraced: the server
    now reads as the agent's user in a forked child that the kernel keeps undumpable."""
    env = make_env("desktop/terminal-mkdir", screen=SCREEN, max_steps=80, isolation=isolation)
    try:
        env.reset()
        put_file(env, "/home/user/.fake.py", FAKE_SCORE)
        env.step(Action(kind="type", text="nohup python3 ~/.fake.py ~/.hits >/dev/null 2>&1 &\n"))
        deadline = time.monotonic() + 30
        while env.sandbox.read_file("~/.hits") is None:  # the program runs
            assert time.monotonic() < deadline, "the agent's program did not start"
            time.sleep(0.2)
        _, reward, terminated, _, _ = env.step(Action(kind="finished"))
        assert terminated and reward == 0.0, "a program of the agent faked the checker's answer"
        assert env.sandbox.read_file("~/.hits") == b"", "a process answered for the checker"
        info = env.sandbox.path_info(["~/projects", "~/.fake.py", "/home/user"])
        assert info["~/projects"] is None and info["~/.fake.py"]["kind"] == "file" and info["/home/user"]["kind"] == "dir"
        still_scores(env)
    finally:
        env.close()


def test_a_fifo_where_the_checker_reads_scores_zero_and_holds_nothing():
    """The agent puts a FIFO where the checker reads (`mkfifo ~/todo.txt`). Before, the server's
    open waited for a writer forever: the check timed out as an infrastructure failure (which the
    rollout engine does not score: a way out of a 0) and left a server thread stuck for good."""
    env = make_env("desktop/terminal-write-file", screen=SCREEN, max_steps=80)
    try:
        env.reset()
        typed(env, "rm -f ~/todo.txt; mkfifo ~/todo.txt")
        start = time.monotonic()
        _, reward, terminated, _, _ = env.step(Action(kind="finished"))
        assert terminated and reward == 0.0 and time.monotonic() - start < 30
        assert env.sandbox.read_file("~/todo.txt") is None
        assert env.sandbox.path_info(["~/todo.txt"])["~/todo.txt"]["kind"] == "fifo"
        still_scores(env, "terminal-write-file")
    finally:
        env.close()


def _comm(pid: str) -> str | None:
    """The command name of a process (None once it is gone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def _uid_of(pid: str) -> int | None:
    """The real uid of a live process (None for a zombie: killed, its pid not yet reaped by init)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None
    if status.get("State", "").strip().startswith(("Z", "X")):
        return None
    return int(status["Uid"].split()[0])


def test_a_sandbox_that_cannot_start_says_why(monkeypatch):
    from desktop_sandbox import confinement

    monkeypatch.setattr(confinement, "user_namespaces_refused", lambda: "Operation not permitted")
    monkeypatch.setattr(confinement.os, "geteuid", lambda: 1000)
    with pytest.raises(RuntimeError, match="no isolation mode can run here.*needs root.*apparmor"):
        confinement.choose_isolation("auto")
    with pytest.raises(RuntimeError, match="cannot create namespaces here"):
        confinement.choose_isolation("namespaces")
    monkeypatch.setattr(confinement.os, "geteuid", lambda: 0)
    assert confinement.choose_isolation("auto") == "user"
    with pytest.raises(EnvError, match="unknown desktop limit"):
        try:
            make_env("desktop/terminal-mkdir", limits={"pid": 5})
        except ValueError as e:
            raise EnvError(str(e)) from e


# ---- 10. what GNOME adds (OSWorld's computer: desktop_sandbox/gnome.py) -----------------------

_SHELL_EXTENSION = """
const {{ GLib, Gio }} = imports.gi;
function init() {{
    return {{
        enable() {{
            const out = [];
            for (const path of {paths}) {{
                try {{ out.push(new TextDecoder().decode(GLib.file_get_contents(path)[1])); }}
                catch (e) {{ out.push('refused ' + path); }}
            }}
            try {{ GLib.file_set_contents('{host_file}', 'owned'); out.push('WROTE'); }} catch (e) {{ out.push('nowrite'); }}
            try {{
                new Gio.SocketClient().connect(new Gio.UnixSocketAddress({{ path: '{socket}' }}), null);
                out.push('CONNECTED');
            }} catch (e) {{ out.push('noconnect'); }}
            out.push('ENV ' + GLib.getenv('ARPO_CANARY_TOKEN'));
            GLib.file_set_contents(GLib.get_home_dir() + '/ext-out.txt', out.join('\\n'));
        }},
        disable() {{}},
    }};
}}
"""


@pytest.mark.skipif(gnome.unavailable() is not None, reason=gnome.unavailable() or "")
def _through_the_run_dialog(box, command: str, done, wait_s: float, attempts: int = 3) -> bool:
    """Type `command` into GNOME's run dialog (Alt+F2) until `done()`: on a loaded machine the
    dialog can open after the first keys were typed, so a try that shows nothing within `wait_s`
    is closed (Escape) and made again."""
    for _ in range(attempts):
        box.run_action("pyautogui.hotkey('alt', 'f2')")
        time.sleep(1.5)
        box.run_action(f"pyautogui.write({command!r}, interval=0.01)\npyautogui.press('enter')")
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if done():
                return True
            time.sleep(0.3)
        box.run_action("pyautogui.press('escape')")
        time.sleep(1.0)
    return False


def test_what_gnome_adds_opens_no_way_out(canaries, monkeypatch, tmp_path):
    """Through GNOME's own doors: the run dialog (Alt+F2), an extension of the agent's loaded into
    GNOME Shell itself (after a shell restart, Alt+F2 `r`), the shell's Eval method, a D-Bus
    service file in the home, the system bus. Host files, a host socket and the host's
    environment stay out of reach, nothing lands on the host, and the next episode is clean."""
    secret, paths = canaries
    monkeypatch.setenv("ARPO_CANARY_TOKEN", secret)
    name = uuid.uuid4().hex[:8]
    host_file = f"/var/tmp/arpo-from-shell-{name}"
    sock_dir = tmp_path / "sock"
    sock_dir.mkdir()
    sock_dir.chmod(0o755)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_dir / "s"))
    listener.listen(4)
    listener.settimeout(0.2)
    os.chmod(sock_dir / "s", 0o777)
    box = Sandbox(SCREEN, window_manager="gnome")
    try:
        # the run dialog: a command as the shell starts it
        command = 'sh -c ' + repr(f'cat {chr(32).join(paths)} > ~/run.txt 2>&1; env >> ~/run.txt')
        assert _through_the_run_dialog(box, command, lambda: box.read_file("~/run.txt") is not None, 20), \
            "the run dialog did not run the command"
        time.sleep(0.5)
        ran = box.read_file("~/run.txt").decode(errors="replace")
        assert secret not in ran and "No such file" in ran, ran[-2000:]
        # an extension of the agent's, enabled, loaded by a shell restart
        ext = f"owned-{name}@agent"
        box.execute(["sh", "-c", 'mkdir -p "$1" && printf %s "$2" > "$1/metadata.json" && printf %s "$3" > "$1/extension.js"',
                     "sh", f"/home/user/.local/share/gnome-shell/extensions/{ext}",
                     json.dumps({"uuid": ext, "name": "o", "description": "o", "shell-version": ["43"]}),
                     _SHELL_EXTENSION.format(paths=json.dumps(paths), host_file=host_file, socket=sock_dir / "s")])
        assert box.execute(["gsettings", "set", "org.gnome.shell", "enabled-extensions", f"['{ext}']"])["returncode"] == 0
        assert _through_the_run_dialog(box, "r", lambda: box.read_file("~/ext-out.txt") is not None, 40), \
            "GNOME Shell did not load the agent's extension"
        out = box.read_file("~/ext-out.txt").decode(errors="replace")
        assert secret not in out and "WROTE" in out and "noconnect" in out and "ENV null" in out, out
        assert not Path(host_file).exists(), "GNOME Shell wrote to the host"
        # D-Bus: the shell's Eval, a service of the agent's, the system bus
        deadline = time.monotonic() + 30
        while True:  # after the restart the shell exports its object again only when it is up
            evaluated = box.execute(["gdbus", "call", "--session", "-d", "org.gnome.Shell", "-o", "/org/gnome/Shell",
                                     "-m", "org.gnome.Shell.Eval", "1 + 1"])
            if "Object does not exist" not in evaluated["error"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert "'2'" not in evaluated["output"] and ("(false" in evaluated["output"] or "denied" in
                                                     evaluated["error"].lower() or "not allowed" in evaluated["error"]), \
            evaluated  # the shell's Eval is off, as on the VM (GNOME 41 and later)
        said = box.execute("mkdir -p ~/.local/share/dbus-1/services; printf '[D-BUS Service]\\n"
                           "Name=org.arpo.Evil\\nExec=/bin/touch /home/user/evil-ran\\n' > "
                           "~/.local/share/dbus-1/services/org.arpo.Evil.service; gdbus call --session -d org.arpo.Evil "
                           "-o / -m org.arpo.Evil.Go 2>&1; gdbus call --system -d org.freedesktop.DBus "
                           "-o /org/freedesktop/DBus -m org.freedesktop.DBus.ListNames", shell=True)["output"]
        assert "ServiceUnknown" in said and box.read_file("~/evil-ran") is None, said
        assert "systemd1" not in said and "login1" not in said and "NetworkManager" not in said, said
        # the next episode: none of it
        box.reset_session()
        clean = box.execute("ls -A ~/.local/share/gnome-shell/extensions 2>/dev/null; "
                            "gsettings get org.gnome.shell enabled-extensions", shell=True)["output"].split()
        assert clean == ["@as", "[]"], clean
    finally:
        box.close()
        listener.close()
        Path(host_file).unlink(missing_ok=True)
