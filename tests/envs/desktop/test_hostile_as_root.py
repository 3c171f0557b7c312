"""The hostile agent with root inside (`env.options.sudo: root`, desktop_sandbox/superuser.py).

OSWorld's agent may `sudo` with the VM's password; with the option on, that is real root inside
the sandbox. Every attack here is typed into the desktop's terminal (attack scripts placed in the
home through the trusted API to keep typing short; running them is always typed) and run as root:
root inside must still read no host file the sandbox does not show, see or signal no host process,
reach no network or host socket, leave none of its namespaces, reach neither the action server nor
the sudo broker, gain nothing through set-uid or file-capability programs, and leave nothing on
the host once the sandbox is closed. tests/envs/desktop/test_hostile.py is the same suite without root.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from arpo_lib.actions import Action
from arpo_lib.envs import make_env
from arpo_lib.envs.base import EnvError
from desktop_sandbox import superuser, usernet
from desktop_sandbox.sandbox import Sandbox, desktop_unavailable
from tests.desktop_sandbox.test_usernet import _PROBE, host_services, test_host  # noqa: F401 (fixtures)
from tests.envs.desktop.test_hostile import (  # noqa: F401 (canaries: a fixture)
    DESKTOPS, PROBE_SOCKETS, PROBE_SYSCALLS, REPO, SCREEN, _host_tasks, _wait_for_incident, canaries, put_file,
    still_scores, typed,
)

REASON = desktop_unavailable() or superuser.unavailable()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.slow,
              # root's attacks go through the same user namespace, overlay and broker on both
              # desktops: the openbox variants run in CI, the GNOME ones under ARPO_LONG_TESTS=1
              pytest.mark.long_variants("gnome")]


@pytest.fixture(scope="module", params=DESKTOPS)
def root_terminal(request):
    """desktop/terminal-mkdir with root inside: a shell in a terminal, and sudo that gives root."""
    env = make_env("desktop/terminal-mkdir", screen=SCREEN, max_steps=500, desktop=request.param, sudo="root")
    yield env
    env.close()


def as_root(env, script: str, timeout: float = 90.0) -> str:
    """Place `script` in the home and type `sudo sh` on it, the password given on stdin (-S)."""
    name = f".r{uuid.uuid4().hex[:8]}.sh"
    put_file(env, f"/home/user/{name}", script)
    return typed(env, f"echo password | sudo -S sh ~/{name}", timeout=timeout)


def typed_at_the_prompt(env, command: str, timeout: float = 60.0) -> str:
    """Type `command`, then the password at sudo's prompt, as a person at the terminal would."""
    marker = uuid.uuid4().hex[:8]
    env.step(Action(kind="type", text=f"({command}) > ~/.o{marker} 2>&1; touch ~/.d{marker}\n"))
    time.sleep(1.5)
    env.step(Action(kind="type", text="password\n"))
    deadline = time.monotonic() + timeout
    while env.sandbox.read_file(f"~/.d{marker}") is None:
        assert time.monotonic() < deadline, f"the typed command did not finish within {timeout} s: {command}"
        time.sleep(0.2)
    return (env.sandbox.read_file(f"~/.o{marker}") or b"").decode(errors="replace")


def _block(env) -> range:
    first = env.sandbox.id_block
    return range(first, first + superuser.ID_COUNT)


def _processes_of(ids: range) -> list[str]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                status = Path(f"/proc/{entry.name}/status").read_text()
            except OSError:
                continue
            uid = int(status.split("Uid:")[1].split()[0])
            if uid in ids and "State:\tZ" not in status:
                found.append(f"{entry.name} {Path(f'/proc/{entry.name}/comm').read_text().strip()}")
    return found


# ---- host files -------------------------------------------------------------------------------------

def test_root_reads_no_host_file(root_terminal, canaries):
    """The canaries of the suite without root, and more: a root-only file inside a tree the sandbox
    shows (/usr: the overlay reads the host as an unprivileged uid, so root inside is refused too),
    one in dpkg's directory (hidden by the seed), a world-readable one in /opt beside Chrome's."""
    secret, paths = canaries
    tag = secret[:8]
    extra = [(f"/usr/local/share/arpo-canary-{tag}", 0o600), (f"/var/lib/dpkg/arpo-canary-{tag}", 0o600),
             (f"/opt/arpo-canary-{tag}", 0o644)]
    for path, mode in extra:
        Path(path).write_text(f"canary {secret}\n")
        os.chmod(path, mode)
    try:
        root_terminal.reset()
        out = typed_at_the_prompt(root_terminal, f"sudo cat {' '.join(paths + [p for p, _ in extra])}; sudo id -u; id -u")
        assert out.split()[-2:] == ["0", "1000"], out  # root was given (the second sudo remembers); the shell is user's
        assert secret not in out and "Permission denied" in out, out  # /usr/local's: there, and refused to root
        # the secret in two halves: the script itself, in the home, must not be what grep finds
        out = as_root(root_terminal, f"ls -a {REPO} /root /srv /home /opt /var/lib; s={secret[:16]}; "
                                     f"grep -rs $s{secret[16:]} /etc /var /srv /opt /home /root /usr/local /tmp /run; "
                                     "cat /etc/shadow /etc/gshadow /etc/sudoers /etc/ssh/* 2>&1; id -u")
        assert secret not in out and out.split()[-1] == "0", out[-3000:]
        assert f"ls: cannot access '{REPO}'" in out and "arpo-canary" not in out, out[-3000:]
        hashes = {line.split(":")[1] for line in out.splitlines() if line.count(":") == 8}
        assert hashes and hashes <= {"*", superuser.ROOT_PASSWORD_HASH}, hashes  # the sandbox's accounts, not the host's
        still_scores(root_terminal)
    finally:
        for path, _ in extra:
            Path(path).unlink(missing_ok=True)


# ---- host processes ---------------------------------------------------------------------------------

def test_root_sees_and_signals_no_host_process(root_terminal):
    marker = f"arpo-host-{uuid.uuid4().hex[:8]}"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker])
    try:
        root_terminal.reset()
        put_file(root_terminal, "/home/user/.m", marker + "\n")  # so the marker is in no typed command line
        out = as_root(root_terminal, "echo seen=$(cat /proc/[0-9]*/cmdline | tr '\\0' ' ' | grep -c -F -f /home/user/.m); "
                                     f"kill -9 {sleeper.pid} {os.getpid()}; echo kill=$?; ls -d /proc/[0-9]* | wc -l")
        assert "seen=0" in out, out
        assert sleeper.poll() is None, "root inside killed a host process"
        assert int(out.split()[-1]) < 200, out  # the sandbox's own processes only
        # root ends everything it sees: its own desktop, nothing of the host
        try:
            root_terminal.step(Action(kind="type", text="echo password | sudo -S kill -9 -1\n"))
        except EnvError:
            pass
        deadline = time.monotonic() + 30
        while root_terminal.sandbox.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not root_terminal.sandbox.alive(), "kill -9 -1 as root did not end the sandbox's processes"
        assert sleeper.poll() is None
        still_scores(root_terminal)  # a new sandbox
    finally:
        sleeper.kill()
        sleeper.wait()


# ---- network and host sockets -------------------------------------------------------------------------

def test_root_reaches_no_host_socket_and_cannot_change_the_network(root_terminal):
    name = uuid.uuid4().hex[:8]
    directory = Path(f"/var/tmp/arpo-sock-{name}")
    directory.mkdir()
    directory.chmod(0o755)
    listeners, connections, stop = [], [], threading.Event()
    for family, address in ((socket.AF_UNIX, str(directory / "s")), (socket.AF_UNIX, f"\0arpo-canary-{name}"),
                            (socket.AF_INET, ("0.0.0.0", 0))):
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen(4)
        listener.settimeout(0.2)
        listeners.append(listener)
    os.chmod(directory / "s", 0o777)
    port = listeners[2].getsockname()[1]

    def accept(listener):
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
                connections.append(str(listener.getsockname()))
                connection.close()
            except OSError:
                continue

    for listener in listeners:
        threading.Thread(target=accept, args=(listener,), daemon=True).start()
    v4, _ = usernet.host_addresses()
    try:
        root_terminal.reset()
        put_file(root_terminal, "/home/user/probe.py", textwrap.dedent(f"""\
            import socket
            targets = [(socket.AF_UNIX, {str(directory / 's')!r}), (socket.AF_UNIX, '\\0arpo-canary-{name}')]
            targets += [(socket.AF_INET, (a, {port})) for a in {v4!r}]
            for family, address in targets:
                c = socket.socket(family)
                c.settimeout(3)
                try:
                    c.connect(address)
                    print('CONNECTED', address)
                except OSError as e:
                    print('refused', address, e)
            """))
        out = as_root(root_terminal, "python3 /home/user/probe.py; ip link set lo down; ip addr add 10.9.9.9/32 dev lo; "
                                     "ip route add 169.254.169.254 dev lo; iptables -F; ip link add d0 type dummy; "
                                     "ip -br link")
        tried = [line.split()[0] for line in out.split(": ", 1)[-1].splitlines() if line.startswith(("refused", "CONNECTED"))]
        assert tried == ["refused"] * (2 + len(v4)), out
        assert out.count("Operation not permitted") >= 4 and "Permission denied (you must be root)" in out, out
        assert "d0" not in out and "LOOPBACK,UP" in out, out
        assert connections == []
        still_scores(root_terminal)
    finally:
        stop.set()
        for listener in listeners:
            listener.close()
        subprocess.run(["rm", "-rf", str(directory)])


# ---- leaving the sandbox ------------------------------------------------------------------------------

def test_root_leaves_none_of_its_namespaces_and_reaches_neither_server_nor_broker(root_terminal):
    root_terminal.reset()
    out = as_root(root_terminal, "unshare -Ur id; unshare -m true; unshare -n true; mkdir /tmp/m; mount -t tmpfs none "
                                 "/tmp/m; mount --bind /usr /tmp/m; echo mounts=$(grep -c /tmp/m /proc/self/mounts); "
                                 "chroot / true; mknod /tmp/sda b 8 0; ls /sys; sysctl -w kernel.panic=1; id -u")
    assert "uid=0" not in out and out.split()[-1] == "0" and "mounts=0" in out, out
    assert out.count("Operation not permitted") == 5 and "ls: cannot access '/sys'" in out, out
    assert "permission denied on key" in out, out
    put_file(root_terminal, "/home/user/syscalls.py", PROBE_SYSCALLS)
    out = as_root(root_terminal, "python3 /home/user/syscalls.py")
    results = dict(line.split(" returned ") for line in out.splitlines() if " returned " in line)
    assert len(results) == 20, out
    for name, result in results.items():
        expected = "errno 38" if name == "clone3" else "errno 1"
        assert result.startswith("-1 ") and result.endswith(expected), f"{name} as root: {result}"
    # the action server (pid 2, undumpable) and the broker: no descriptor, memory or environment,
    # as root and as root turned `user` (the server's own uid)
    put_file(root_terminal, "/home/user/probe.py", PROBE_SOCKETS)
    out = as_root(root_terminal, "broker=$(pgrep -u root -f ' init --grant-fd' | grep -vx 1 | head -n 1); echo broker=$broker; "
                                 "python3 /home/user/probe.py; for p in 2 $broker; do head -c 1 /proc/$p/mem; "
                                 "cat /proc/$p/environ; done; setpriv --reuid 1000 --regid 1000 --clear-groups "
                                 "sh -c 'cat /proc/2/environ; ls -l /proc/2/fd/'")
    broker = out.split("broker=")[1].split()[0]
    assert broker.isdigit() and broker != "2", out[-3000:]
    reached = [line for line in out.splitlines() if line.startswith(("LINK 2 ", "OPENED 2 ", f"LINK {broker} ",
                                                                      f"OPENED {broker} ", "STOLE"))]
    assert reached == [] and '"ok": true' not in out and "HTTP/1" not in out, reached or out[-3000:]
    workdir = str(root_terminal.sandbox.workdir)  # no descriptor of any process inside is a host file
    assert [line for line in out.splitlines() if line.startswith("LINK ") and workdir in line] == [], out[-3000:]
    assert out.count("Permission denied") >= 5, out[-3000:]
    still_scores(root_terminal)


def test_set_uid_and_file_capability_programs_root_writes_give_nothing(root_terminal):
    """Root writes a set-uid-root shell and a program with file capabilities (CAP_SYS_PTRACE,
    CAP_DAC_READ_SEARCH) where `user` can run them; run by `user` they run as `user`, without any
    capability (no_new_privs), and the server stays out of reach. The shims stay read-only."""
    root_terminal.reset()
    caps = struct.pack("<IIIII", 0x02000001, (1 << 19) | (1 << 2), 0, 0, 0)  # VFS_CAP_REVISION_2, effective
    out = as_root(root_terminal, "for d in /tmp /home/user /var/tmp /dev/shm; do cp /bin/bash $d/rootsh; "
                                 "chmod 4755 $d/rootsh; done; cp /bin/cat /tmp/capcat; "
                                 "python3 -c \"import os, sys; os.setxattr('/tmp/capcat', 'security.capability', "
                                 f"bytes.fromhex('{caps.hex()}')); print('capset')\"; ls -l /tmp/rootsh; "
                                 "echo owned > /opt/arpo/bin/sudo; echo owned > /opt/arpo/lib/desktop_sandbox/sudo.py")
    assert "-rwsr-xr-x 1 root root" in out and "capset" in out, out
    assert out.count("Read-only file system") == 2, out
    out = typed(root_terminal, "for d in /tmp ~ /var/tmp /dev/shm; do $d/rootsh -p -c 'id -u; id -u -r'; done; "
                               "/tmp/capcat /proc/self/status | grep CapEff; /tmp/capcat /proc/2/environ; "
                               "/tmp/rootsh -p -c 'ls -l /proc/2/fd/'")
    assert out.split()[:8] == ["1000"] * 8, out
    assert "CapEff:\t0000000000000000" in out and out.count("Permission denied") >= 2, out
    assert root_terminal.sandbox.execute("echo password | sudo -S id -u", shell=True)["output"] == "0\n"
    still_scores(root_terminal)


def test_a_reset_after_root_undoes_everything_root_did(root_terminal):
    root_terminal.reset()
    pid = root_terminal.sandbox.process.pid
    out = as_root(root_terminal, "touch /usr/local/bin/evil /etc/evil /evil; hostname evil; useradd -M evil; "
                                 "(setsid sleep 1000 &); chmod 777 /usr/bin; echo done")
    assert out.split()[-1] == "done", out
    root_terminal.reset()
    box = root_terminal.sandbox
    assert box.process.pid != pid
    after = box.execute("ls /usr/local/bin/evil /etc/evil /evil 2>&1; hostname; getent passwd evil; "
                        "stat -c %a /usr/bin; pgrep -x sleep; echo end", shell=True)["output"]
    assert after.count("No such file or directory") == 3 and "user-virtual-machine" in after, after
    assert "evil:" not in after and after.split()[-2:] == ["755", "end"], after
    quiet = box.process.pid
    root_terminal.reset()  # no root in that episode: a plain reset, the same sandbox
    assert root_terminal.sandbox.process.pid == quiet
    still_scores(root_terminal)


# ---- limits -----------------------------------------------------------------------------------------

def test_a_fork_bomb_started_with_sudo_ends_its_own_episode_not_the_machine():
    """The action server runs as `user` and cannot signal root's processes: before, a fork bomb
    started with sudo outlived every round of the limits' watcher (each gave up after 20 s, "N
    processes of the episode survived"), bounded only by the kernel. Now the server asks the root
    broker, over a channel only the server holds, to end the episode's processes: the bomb ends at
    once, the desktop (the same sandbox) stays, the incident is reported."""
    pids = 256
    env = make_env("desktop/terminal-mkdir", screen=SCREEN, max_steps=50, sudo="root", limits={"pids": pids})
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _host_tasks())
            time.sleep(0.05)

    try:
        env.reset()
        box = env.sandbox
        process, baseline = box.process.pid, _host_tasks()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        env.step(Action(kind="type", text="echo password | sudo -S bash -c 'b(){ b|b& };b'\n"))
        incidents = _wait_for_incident(box)
        took = time.monotonic() - started
        time.sleep(1.0)
        stop.set()
        sampler.join()
        assert incidents and incidents[0].startswith("pids limit"), incidents
        assert "survived" not in " ".join(incidents) and took < 15, (took, incidents)
        assert box.grants.granted() and box.process.pid == process and box.alive()  # the same desktop
        left = box.execute(["sh", "-c", "pgrep -u root -x bash | wc -l; pgrep -u user -x bash | wc -l"])["output"].split()
        assert left == ["0", "0"], f"the bomb's processes outlived the incident: {left}"
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
        assert peak[0] - baseline < pids + 5000 and peak[0] < pid_max // 2, f"the bomb reached {peak[0] - baseline} tasks"
        still_scores(env)
    finally:
        stop.set()
        env.close()


# ---- nothing left on the host -----------------------------------------------------------------------

WRITE_EVERYWHERE = """
for d in / /usr /usr/local/bin /etc /var /var/lib /opt /root /tmp /var/tmp /dev/shm /run /home/user; do
  echo left > "$d/arpo-left-{tag}" && cp /bin/sh "$d/arpo-left-{tag}.sh" && chmod 4755 "$d/arpo-left-{tag}.sh"
done
dd if=/dev/zero of=/usr/local/arpo-left-{tag}.big bs=1M count=20 2>&1 | tail -1
(setsid sleep 1000 &)
echo wrote
"""


def test_root_leaves_nothing_on_the_host():
    tag = uuid.uuid4().hex[:8]
    env = make_env("desktop/terminal-mkdir", screen=SCREEN, max_steps=100, sudo="root")
    try:
        env.reset()
        ids, workdir = _block(env), env.sandbox.workdir
        out = as_root(env, WRITE_EVERYWHERE.format(tag=tag))
        assert "wrote" in out and "20971520 bytes" in out, out
        usage = subprocess.run(["du", "-sm", str(workdir)], capture_output=True, text=True).stdout
        assert int(usage.split()[0]) < 10, f"root's writes landed on the host: {usage}"
        assert _processes_of(ids), "no process of the sandbox's uids while it runs"
    finally:
        env.close()
    deadline = time.monotonic() + 20
    while (_processes_of(ids) or workdir.exists()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_of(ids) == [] and not workdir.exists(), (_processes_of(ids), workdir.exists())
    left = [f"{d}/arpo-left-{tag}{end}" for d in ("", "/usr", "/usr/local/bin", "/etc", "/var", "/var/lib", "/opt", "/root",
                                                "/tmp", "/var/tmp", "/dev/shm", "/run", "/home/user") for end in ("", ".sh")]
    assert [path for path in left if os.path.lexists(path)] == [] and not Path(f"/usr/local/arpo-left-{tag}.big").exists()
    owned = subprocess.run(["find", "/tmp", "/var/tmp", "/dev/shm", "/run", "-xdev", "-uid", str(ids.start), "-o", "-uid",
                            str(ids.start + 1000)], capture_output=True, text=True).stdout
    assert owned == "", owned
    assert "fuse" not in Path("/proc/self/mounts").read_text(), "a mount of the sandbox is left on the host"


def test_the_work_directory_and_every_process_go_when_the_owner_is_killed():
    script = ("import sys, time; sys.path.insert(0, %r); from desktop_sandbox.sandbox import Sandbox; "
              "box = Sandbox((640, 480), sudo='root'); "
              "box.execute('echo password | sudo -S setsid sleep 1000 >/dev/null 2>&1 &', shell=True); "
              "print(box.workdir, box.id_block, flush=True); time.sleep(600)" % str(REPO))
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    line = next(line for line in owner.stdout if line.startswith("/"))
    workdir, first = Path(line.split()[0]), int(line.split()[1])
    ids = range(first, first + superuser.ID_COUNT)
    assert workdir.is_dir() and _processes_of(ids)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 20
    while (workdir.exists() or _processes_of(ids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not workdir.exists() and _processes_of(ids) == [], (workdir.exists(), _processes_of(ids))


# ---- with the user-mode network ---------------------------------------------------------------------------

@pytest.mark.skipif(usernet.unavailable() is not None, reason=usernet.unavailable() or "")
def test_root_cannot_lift_the_user_networks_fence(test_host, host_services):
    outside, tag = test_host
    ports, hits = host_services
    targets = {"outside": (outside, 8080), "host loopback": ("127.0.0.1", ports["loopback"]),
               "metadata": ("169.254.169.254", 80), "gateway": ("192.0.2.1", ports["any"])}
    targets.update({f"host address {n}": (a, ports["any"]) for n, a in enumerate(ports["addresses"])})
    with Sandbox(SCREEN, window_manager="openbox", network="user", sudo="root") as box:
        lift = box.execute("echo password | sudo -S sh -c 'iptables -F OUTPUT; echo $?; ip route add 169.254.169.254 "
                           "dev lo; echo $?; ip link set eth0 down; echo $?; nft flush ruleset; echo $?'", shell=True)
        assert [n for n in lift["output"].split() if n == "0"] == [], lift
        done = box.execute(["sh", "-c", 'echo password | sudo -S python3 -c "$1" "$2" "$3"', "sh", _PROBE,
                            json.dumps(targets), f"http://{outside}:8080/"], timeout=90)
        seen = json.loads(done["output"].strip().splitlines()[-1])
        assert seen["outside"] == "connected" and seen["page"] == f"outside {tag}", seen
        assert [name for name, result in seen.items() if result == "connected" and name != "outside"] == [], seen
    assert hits == [], f"a host service answered root inside: {hits}"
