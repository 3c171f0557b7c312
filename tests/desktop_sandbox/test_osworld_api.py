"""OSWorld's server API on the desktop sandbox, spoken the way OSWorld's own controllers speak it
(requests: multipart uploads, form fields, POSTs without a body) through the host's loopback
bridge, and what the agent inside can and cannot reach of it."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time

import pytest
import requests

from desktop_sandbox import a11y, windows
from desktop_sandbox.bridge import LoopbackBridge
from desktop_sandbox.sandbox import Sandbox, _UnixConnection, desktop_unavailable
from desktop_sandbox.files import multipart_fields as _multipart
from desktop_sandbox.http_input import RequestError

REASON = desktop_unavailable()
needs_desktop = pytest.mark.skipif(REASON is not None, reason=REASON or "")
SCREEN = (1280, 800)


# ---- pieces without a sandbox ------------------------------------------------------------------

def test_multipart_fields_as_requests_encodes_them():
    prepared = requests.Request("POST", "http://x/setup/upload", data={"file_path": "/home/user/a b.xlsx"},
                                files={"file_data": ("a b.xlsx", b"PK\x03\x04\r\n--\x00binary\r\n")}).prepare()
    fields = _multipart(prepared.headers["Content-Type"], prepared.body)
    assert fields == {"file_path": b"/home/user/a b.xlsx", "file_data": b"PK\x03\x04\r\n--\x00binary\r\n"}
    with pytest.raises(RequestError, match="multipart/form-data"):
        _multipart("application/json", b"{}")
    with pytest.raises(RequestError, match="boundary"):
        _multipart("multipart/form-data", b"")


def test_window_names_follow_wmctrls_rules():
    ws = [windows.Window(1, "notes.txt - Mousepad", "mousepad.Mousepad", 0, 0, 10, 10),
          windows.Window(2, "Mousepad", "mousepad.Mousepad", 0, 0, 10, 10),
          windows.Window(3, "Untitled 1 - LibreOffice Calc", "libreoffice.libreoffice-calc", 0, 0, 10, 10)]
    assert [w.id for w in windows.find(ws, "mousepad")] == [1, 2]  # substring, any case, oldest first
    assert [w.id for w in windows.find(ws, "Mousepad", strict=True)] == [2]  # exact, case-sensitive
    assert windows.find(ws, "mousepad", strict=True) == []
    assert [w.id for w in windows.find(ws, "calc", by_class=True)] == [3]
    assert [w.id for w in windows.find(ws, "libreoffice.libreoffice-calc", strict=True, by_class=True)] == [3]


_OTHER_USER_CLIENT = r"""
import socket, sys, time
port, mode = int(sys.argv[1]), sys.argv[2]
c = socket.create_connection(("127.0.0.1", port))
c.sendall(b"POST /execute HTTP/1.1\r\n\r\nrm -rf ~\n")
if mode == "close":  # send, then close at once: the kernel's table keeps no owner for a closed socket
    c.close()
    sys.exit(0)
c.settimeout(10)
try:
    print(repr(c.recv(100)))
except OSError as e:
    print(type(e).__name__)
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None or not os.path.exists("/usr/bin/python3"),
                    reason="needs root, setpriv and the system Python to run a client as nobody")
def test_the_bridge_serves_only_this_user_and_root_on_a_shared_machine(tmp_path):
    """The bridge's ports are on the host's loopback: every account of a shared machine can connect.
    Only this process's user (and root) reach the sandbox: another user's bytes, even sent before it
    closes at once, never arrive (before: they went straight to the server's /execute)."""
    received: list[bytes] = []
    path = str(tmp_path / "server.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()

    def serve() -> None:  # an echo server standing in for the sandbox's action server
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                data = conn.recv(100)
                received.append(data)
                conn.sendall(b"echo:" + data[:10])

    threading.Thread(target=serve, daemon=True).start()
    client = ["/usr/bin/python3", "-I", "-c", _OTHER_USER_CLIENT]  # an interpreter any user may run
    nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *client]
    try:
        with LoopbackBridge(path) as bridge:
            port = str(bridge.ports["server"])
            mine = subprocess.run([*client, port, "read"], capture_output=True, text=True, timeout=30)
            assert mine.stdout.strip() == repr(b"echo:POST /exec"), mine
            for mode in ("read", "close"):
                theirs = subprocess.run([*nobody, port, mode], capture_output=True, text=True, timeout=30)
                assert theirs.returncode == 0, theirs.stderr
                if mode == "read":
                    assert theirs.stdout.strip() in (repr(b""), "ConnectionResetError"), theirs.stdout
            time.sleep(0.5)
            assert received == [b"POST /execute HTTP/1.1\r\n\r\nrm -rf ~\n"]  # ours only
            assert bridge._refused == 2
    finally:
        server.close()


# ---- the API on a real sandbox -----------------------------------------------------------------

@pytest.fixture(scope="module")
def desktop():
    if REASON:
        pytest.skip(REASON)
    with Sandbox(SCREEN) as box, LoopbackBridge(box.socket_path) as bridge:
        yield box, bridge, f"http://127.0.0.1:{bridge.ports['server']}"


@pytest.fixture
def fresh(desktop):
    box, bridge, base = desktop
    box.reset_session()
    return box, bridge, base


def test_upload_list_and_read_back_as_osworlds_controllers_send_them(fresh):
    box, bridge, base = fresh
    content = bytes(range(256)) * 4000  # ~1 MB, every byte value
    r = requests.post(f"{base}/setup/upload", data={"file_path": "/home/user/data/in/sheet.xlsx"},
                      files={"file_data": ("sheet.xlsx", content)}, timeout=60)
    assert r.status_code == 200, r.text
    requests.post(f"{base}/setup/upload", data={"file_path": "~/top.txt"}, files={"file_data": ("top.txt", b"x")},
                  timeout=60).raise_for_status()
    r = requests.post(f"{base}/file", data={"file_path": "/home/user/data/in/sheet.xlsx"}, timeout=60)
    assert r.status_code == 200 and r.content == content
    tree = requests.post(f"{base}/list_directory", json={"path": "/home/user/data"}, timeout=60).json()
    assert tree == {"directory_tree": {"type": "directory", "name": "data", "children": [
        {"type": "directory", "name": "in", "children": [{"type": "file", "name": "sheet.xlsx"}]}]}}
    home = requests.post(f"{base}/list_directory", json={"path": "~"}, timeout=60).json()["directory_tree"]
    assert {c["name"] for c in home["children"]} == {"Desktop", "Documents", "Downloads", "data", "top.txt"}
    # POSTs without a body, as PythonController sends them
    assert requests.post(f"{base}/screen_size", timeout=60).json() == {"width": SCREEN[0], "height": SCREEN[1]}
    assert requests.post(f"{base}/desktop_path", timeout=60).json() == {"desktop_path": "/home/user/Desktop"}
    missing = requests.post(f"{base}/list_directory", json={"path": "/home/user/nope"}, timeout=60)
    assert missing.status_code == 404 and "not a directory" in missing.json()["error"]
    bad = requests.post(f"{base}/setup/upload", data={"file_path": "/home/user/x"}, timeout=60)  # not multipart
    assert bad.status_code == 400 and "multipart" in bad.json()["error"]


def test_wallpaper_is_what_the_set_up_step_named(fresh):
    box, bridge, base = fresh
    assert requests.post(f"{base}/wallpaper", timeout=60).status_code == 404
    box.execute("printf 'PNGDATA' > ~/wall.png", shell=True)
    assert requests.post(f"{base}/setup/change_wallpaper", json={"path": "~/wall.png"}, timeout=60).status_code == 200
    assert requests.post(f"{base}/wallpaper", timeout=60).content == b"PNGDATA"


def test_python_in_a_trusted_command_is_the_workbenchs_and_the_agent_cannot_replace_it(fresh):
    """OSWorld's getters run `python -c "import pyautogui; ..."` (e.g. its platform probe)."""
    box, bridge, base = fresh
    probe = {"command": ["python", "-c", "import pyautogui; import time; pyautogui.FAILSAFE = False; "
                                         "import platform; print(platform.system(), *pyautogui.size())"],
             "shell": False}
    assert requests.post(f"{base}/execute", json=probe, timeout=60).json()["output"] == f"Linux {SCREEN[0]} {SCREEN[1]}\n"
    # The agent's own attempts (what it could type into a terminal): overwrite the shim, or put a
    # `python` earlier on the PATH (the home and /tmp are not on it), or a pyautogui.py in the home.
    attack = box.execute("echo 'print(666)' > /opt/arpo/bin/python; mkdir -p ~/bin ~/.local/bin; "
                         "printf '#!/bin/sh\\necho owned\\n' | tee ~/bin/python ~/.local/bin/python /tmp/python "
                         ">/dev/null; chmod +x ~/bin/python ~/.local/bin/python /tmp/python; "
                         "echo 'raise SystemExit(\"owned\")' > ~/pyautogui.py", shell=True)
    assert "Read-only file system" in attack["error"]
    again = requests.post(f"{base}/execute", json=probe, timeout=60).json()
    assert again["output"] == f"Linux {SCREEN[0]} {SCREEN[1]}\n", again
    # A string without a shell is split shell-style, and ~/ arguments name the home (OSWorld's server)
    split = requests.post(f"{base}/execute", json={"command": "printf '%s|' 'a b' ~/x", "shell": False}, timeout=60)
    assert split.json()["output"] == "a b|/home/user/x|"
    # The string "true" for shell (seven of OSWorld's task files write it so)
    assert requests.post(f"{base}/execute", json={"command": "echo $HOME", "shell": "true"},
                         timeout=60).json()["output"] == "/home/user\n"


def test_sudo_takes_osworlds_password_and_gives_no_privilege(fresh):
    """Task set-ups run `echo password | sudo -S <command>` (OSWorld's VM user's password)."""
    box, bridge, base = fresh

    def shell(command):
        return requests.post(f"{base}/setup/execute", json={"command": command, "shell": True}, timeout=60).json()

    shell("echo 'password' | sudo -S mkdir ~/Desktop/todo_list_Jan_1")
    assert box.execute("test -d ~/Desktop/todo_list_Jan_1 && echo made", shell=True)["output"] == "made\n"
    wrong = box.execute("echo hunter2 | sudo -S touch ~/nope; echo rc=$?; test -e ~/nope || echo absent", shell=True)
    assert "rc=1" in wrong["output"] and "absent" in wrong["output"] and "Sorry, try again." in wrong["error"]
    who = box.execute("echo password | sudo -S -u root id -u; id -u", shell=True)["output"].split()
    assert who[0] == who[1]  # no privilege: the command runs as the sandbox's own user
    denied = box.execute("echo password | sudo -S sh -c 'echo x > /etc/arpo-sudo-test'; echo rc=$?", shell=True)
    assert "rc=0" not in denied["output"]


def test_open_file_uses_the_vms_default_applications_and_the_agent_cannot_change_them_for_later(fresh):
    """/setup/open_file is xdg-open: a text file opens in the text editor (the VM's gedit; Debian's
    own default would be LibreOffice Writer), web pages and links in `google-chrome`."""
    box, bridge, base = fresh
    if shutil.which("xdg-open") is None or shutil.which("xdg-mime") is None:
        pytest.skip("needs xdg-utils (./workbench setup-desktop --osworld installs it)")
    query = "for t in text/plain text/html x-scheme-handler/https application/vnd.oasis.opendocument.text; " \
            "do xdg-mime query default $t; done"
    # one line per type, empty where no application is installed for it
    defaults = [line.strip() for line in box.execute(query, shell=True)["output"].split("\n")][:4]
    assert defaults[0] == "org.xfce.mousepad.desktop", defaults
    if shutil.which("chromium") or shutil.which("google-chrome"):
        assert defaults[1:3] == ["google-chrome.desktop"] * 2, defaults
    # Office files keep Debian's default: LibreOffice Writer, where setup-desktop --osworld installed it
    assert defaults[3] == ("libreoffice-writer.desktop" if shutil.which("libreoffice") else ""), defaults
    requests.post(f"{base}/setup/upload", data={"file_path": "/home/user/notes.txt"},
                  files={"file_data": ("notes.txt", b"hello\n")}, timeout=60).raise_for_status()
    opened = requests.post(f"{base}/setup/open_file", json={"path": "/home/user/notes.txt", "timeout": 60}, timeout=90)
    assert opened.status_code == 200, opened.text
    assert any("notes.txt" in w.title and "mousepad" in w.wm_class.lower() for w in _windows(box)), _windows(box)
    # The defaults live in the read-only shim directory; the agent may set its own for this
    # episode (as on the VM), and a reset's fresh home takes them away again.
    # (its own choice must name an installed entry: xdg-mime skips those it cannot find)
    attack = box.execute("echo 'text/plain=evil.desktop' >> /opt/arpo/bin/xdg/mimeapps.list; "
                         "mkdir -p ~/.config && printf '[Default Applications]\\ntext/plain=pcmanfm.desktop\\n' "
                         "> ~/.config/mimeapps.list; xdg-mime query default text/plain", shell=True)
    # refused as the shims' owner's (the host's root) or, for a truncating write, as a read-only mount
    assert "Permission denied" in attack["error"] or "Read-only file system" in attack["error"], attack
    assert attack["output"].strip() == "pcmanfm.desktop", attack
    assert "evil" not in box.execute(["cat", "/opt/arpo/bin/xdg/mimeapps.list"])["output"]
    box.reset_session()
    assert box.execute("xdg-mime query default text/plain", shell=True)["output"].strip() == "org.xfce.mousepad.desktop"


def test_windows_are_activated_measured_and_closed_by_osworlds_rules(fresh):
    box, bridge, base = fresh
    box.execute("printf a > ~/first.txt", shell=True)
    box.launch(["mousepad", "/home/user/first.txt"])
    _wait_for(lambda: windows.find(_windows(box), "first.txt"), "first.txt's window")
    box.launch(["stterm", "-t", "Second Window"])
    _wait_for(lambda: windows.find(_windows(box), "Second Window"), "the terminal's window")

    def post(path: str, **body: object) -> dict:
        r = requests.post(f"{base}{path}", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    assert post("/setup/activate_window", window_name="FIRST.TXT", strict=False, by_class=False)["windows"] == \
        ["~/first.txt - Mousepad"]
    _wait_for(lambda: "first.txt" in box.active_window().get("name", ""), "first.txt focused")
    assert post("/setup/activate_window", window_name="second window", strict=True)["windows"] == []  # exact only
    assert post("/setup/activate_window", window_name="Second Window", strict=True)["windows"] == ["Second Window"]
    _wait_for(lambda: box.active_window().get("name") == "Second Window", "the terminal focused")
    size = requests.post(f"{base}/window_size", data={"app_class_name": "MOUSEPAD"}, timeout=60)
    assert size.status_code == 200 and size.json()["width"] > 100 and size.json()["height"] > 100
    assert requests.post(f"{base}/window_size", data={"app_class_name": "gimp"}, timeout=60).status_code == 404
    assert post("/setup/close_window", window_name="mousepad", by_class=True)["windows"] == ["~/first.txt - Mousepad"]
    _wait_for(lambda: [w.title for w in _windows(box)] == ["Second Window"], "only mousepad's window closed")
    x, y = requests.get(f"{base}/cursor_position", timeout=60).json()
    assert 0 <= x < SCREEN[0] and 0 <= y < SCREEN[1]


def test_activate_window_waits_for_the_window_the_step_before_launched(fresh):
    """A task file launches a program and activates its window in the next step; GNOME maps a
    new window a second or more after the launch. The step waits for it (ACTIVATE_WAIT_S) and
    reports no set-up failure; a window that never comes is reported after the wait."""
    from desktop_sandbox import session as server

    box, bridge, base = fresh
    requests.post(f"{base}/setup/begin", timeout=30)
    box.launch(["sh", "-c", "sleep 1.5; exec stterm -t 'Late Window'"])
    r = requests.post(f"{base}/setup/activate_window", json={"window_name": "Late Window", "strict": True}, timeout=60)
    assert r.status_code == 200 and r.json()["windows"] == ["Late Window"], r.text
    _wait_for(lambda: box.active_window().get("name") == "Late Window", "the late window focused")
    started = time.monotonic()
    r = requests.post(f"{base}/setup/activate_window", json={"window_name": "Never Window"}, timeout=60)
    assert r.json()["windows"] == [] and time.monotonic() - started >= server.ACTIVATE_WAIT_S - 0.5
    r = requests.post(f"{base}/setup/close_window", json={"window_name": "Never Window"}, timeout=60)
    assert r.json()["windows"] == []
    report = requests.get(f"{base}/setup/report", timeout=60).json()
    assert [s["step"] for s in report["steps"] if s["step"] != "launch"] == ["activate_window"] * 2 + ["close_window"]
    assert len(report["failures"]) == 2 and "no window matched 'Never Window'" in report["failures"][0], report


def test_chrome_devtools_through_the_bridge_and_nothing_of_the_host_from_inside(fresh):
    """What OSWorld's chrome getters and set-up steps do (CDP at chromium_port) works; the agent
    reaches neither the bridge's ports nor any other in-sandbox port through the server."""
    box, bridge, base = fresh
    box.launch("chromium --no-sandbox --test-type --no-first-run --remote-debugging-port=1337 "
               "--user-data-dir=/tmp/profile about:blank", shell=True)
    cdp = f"http://127.0.0.1:{bridge.ports['chromium']}"

    def version() -> dict | None:
        try:
            return requests.get(f"{cdp}/json/version", timeout=5).json()
        except requests.RequestException:
            return None

    info = _wait_for(version, "Chrome's DevTools through the bridge", timeout=60)
    # Chrome names its websocket by the Host it was asked under: the bridge's port, so a CDP client
    # (Playwright's connect_over_cdp) stays on the bridge.
    assert info["webSocketDebuggerUrl"].startswith(f"ws://127.0.0.1:{bridge.ports['chromium']}/devtools/browser/")
    assert any(t.get("url") == "about:blank" for t in requests.get(f"{cdp}/json/list", timeout=10).json())
    inside = box.execute(["python3", "-c", "import socket, sys\nfor p in map(int, sys.argv[1:]):\n"
                          "    s = socket.socket()\n    s.settimeout(2)\n    print(p, s.connect_ex(('127.0.0.1', p)))",
                          *(str(p) for p in bridge.ports.values())])
    assert all(line.split()[1] != "0" for line in inside["output"].splitlines()), inside  # refused: own network
    # CONNECT only to the tunnel ports (a host caller cannot use the server as a proxy elsewhere)
    connection = _UnixConnection(box.socket_path, 10)
    connection.request("CONNECT", "127.0.0.1:22")
    refused = connection.getresponse()
    assert refused.status == 403 and "no tunnel" in json.loads(refused.read())["error"]


def test_what_the_sandbox_cannot_serve_is_a_clear_error(fresh):
    box, bridge, base = fresh
    a11y_tree = requests.get(f"{base}/accessibility", timeout=60)  # as OSWorld's controller asks (test_a11y.py: the tree)
    if a11y.unavailable() is None:
        assert a11y_tree.status_code == 200 and a11y_tree.json()["AT"].startswith("<desktop-frame ")
    else:
        assert a11y_tree.status_code == 501 and a11y.unavailable() in a11y_tree.json()["error"]
    for budget in ("0", "nan", "x", "1e9"):
        r = requests.get(f"{base}/accessibility?budget_s={budget}", timeout=60)
        assert r.status_code == 400 and "budget_s" in r.json()["error"], (budget, r.text)
    for path in ("/run_python", "/run_bash_script"):
        r = requests.post(f"{base}{path}", json={"code": "print(1)", "script": "id"}, timeout=60)
        assert r.status_code == 403 and "agent" in r.json()["error"]
    assert requests.get(f"{base}/terminal", timeout=60).json() == {"status": "success", "output": None}
    if shutil.which("ffmpeg") is None:
        r = requests.post(f"{base}/start_recording", timeout=60)
        assert r.status_code == 501 and "ffmpeg" in r.json()["error"]
    assert requests.post(f"{base}/end_recording", timeout=60).status_code in (400, 501)
    missing = requests.post(f"{base}/setup/open_file", json={"path": "/home/user/nothing.docx"}, timeout=60)
    assert missing.status_code == 404 and "does not exist" in missing.json()["error"]


def _windows(box: Sandbox) -> list[windows.Window]:
    return [windows.Window(**w) for w in box.get_json("/windows")]


def _wait_for(check, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.3)


@pytest.mark.slow
def test_every_set_up_step_that_did_not_do_what_it_asked_is_reported(fresh):
    """The set-up as OSWorld's SetupController sends it; /setup/report names each step that failed
    (a `pkill` that finds nothing is not one; the provider's own calls before /setup/begin do not
    count)."""
    box, _, base = fresh
    requests.post(f"{base}/execute", json={"command": "false", "shell": True}, timeout=30)  # before the set-up
    requests.post(f"{base}/setup/begin", timeout=30)
    calls = [("/execute", {"command": "echo password | sudo -S apt-get install -y no-such-package", "shell": True}),
             ("/execute", {"command": ["pkill", "no-such-program"]}),
             ("/setup/execute", {"command": "true", "shell": True}),
             ("/setup/activate_window", {"window_name": "Terminal"}),
             ("/setup/close_window", {"window_name": "Terminal", "by_class": True}),
             ("/setup/open_file", {"path": "/home/user/missing.txt"}),
             ("/setup/launch", {"command": ["sh", "-c", "echo dying >&2; exit 3"]}),
             ("/setup/launch", {"command": ["sleep", "30"]})]
    for path, body in calls:
        requests.post(f"{base}{path}", json=body, timeout=60)
    time.sleep(1.0)  # the dying program has exited
    report = requests.get(f"{base}/setup/report", timeout=30).json()
    assert [s["step"] for s in report["steps"]] == ["execute", "execute", "execute", "activate_window",
                                                    "close_window", "open", "launch", "launch"]
    failures = report["failures"]
    assert len(failures) == 5, failures
    assert "exited with code 100" in failures[0] and "Unable to locate package no-such-package" in failures[0]
    assert "no window matched 'Terminal'" in failures[1] and "close_window" in failures[2]
    assert "open /home/user/missing.txt: the file does not exist" in failures[3]
    assert "exited with code 3: dying" in failures[4]
    requests.post(f"{base}/setup/begin", timeout=30)
    assert requests.get(f"{base}/setup/report", timeout=30).json() == {"steps": [], "failures": []}
