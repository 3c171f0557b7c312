"""OSWorld's own DesktopEnv (desktop-env 1.0.2: its SetupController, PythonController, getters and
metrics, unchanged) on the desktop sandbox instead of a VM: task files in OSWorld's format set up,
acted on through real GUI actions, and scored by OSWorld's evaluator; the agent's code checked.

These run in the interpreter that has desktop_env (`./workbench setup-osworld`, found by
find_osworld_python()); the pieces that need no desktop_env run everywhere."""
from __future__ import annotations

import functools
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from arpo_lib.actions import Action
from desktop_sandbox import a11y
from arpo_lib.envs.osworld import env as osworld
from arpo_lib.envs.osworld.sandbox_check import solution_actions
from arpo_lib.envs.workers.pool import EnvPool
from arpo_lib.envs.workers.worker import action_payload

REPO = Path(__file__).resolve().parents[3]
TASKS = REPO / "test_data" / "osworld_sandbox"
SCREEN = (1280, 800)


# ---- without desktop_env -----------------------------------------------------------------------

def test_the_sandbox_provider_needs_no_vm_image_and_no_docker(monkeypatch):
    """provider="sandbox" picks the sandbox's DesktopEnv class and skips the Docker preflight (which
    would refuse this machine: no Docker, no KVM) and the VM image."""
    monkeypatch.setattr(osworld, "preflight_docker", lambda *a, **k: pytest.fail("Docker preflight on the sandbox"))
    monkeypatch.setattr(osworld, "_desktop_env_class", lambda spec: spec)
    env = osworld.OSWorldEnv(json.loads((TASKS / "editor-save.json").read_text()), provider="sandbox",
                             download_cache=None)
    try:
        assert env._desktop_env_cls == osworld.SANDBOX_DESKTOP_ENV_CLASS
        assert env._desktop_kwargs["path_to_vm"] == "desktop-sandbox" and env.pause_vm is False
    finally:
        env.close()


def test_importing_the_provider_needs_no_desktop_env():
    code = ("import sys, desktop_sandbox.osworld as s; assert 'desktop_env' not in sys.modules; "
            "print(s.SandboxProvider(screen_size=(800, 600)).screen_size)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "(800, 600)", done.stderr[-2000:]


def test_scripted_solutions_parse():
    for path in sorted(TASKS.glob("*.json")):
        task = json.loads(path.read_text())
        actions = solution_actions(task, SCREEN)
        assert actions[-1].kind == "finished" and len(actions) >= 2, path.name


def test_the_census_reads_what_a_task_file_needs():
    from arpo_lib.envs.osworld.sandbox_census import markdown, static_column

    def task(config=(), result=None, **evaluator):
        return {"id": "t", "config": list(config), "evaluator": {"func": "exact_match", "result": result or
                {"type": "vm_command_line", "command": "true"}, "expected": {"type": "rule"}, **evaluator}}

    tabs = {"type": "chrome_open_tabs", "parameters": {"urls_to_open": ["https://example.org"]}}
    download = {"type": "download", "parameters": {"files": [{"url": "https://drive.google.com/x", "path": "/a"}]}}
    assert static_column(task([tabs, download]))[0] == "internet"  # the live internet wins
    assert static_column(task([download])) == ("download", "1 file(s) from drive.google.com (1)")
    assert static_column(task(result={"type": "cloud_file", "path": "https://h.example/f"}))[0] == "download"
    # GNOME's pieces run on the sandbox's GNOME desktop; VS Code is what Debian does not have
    assert static_column(task([{"type": "execute", "parameters": {"command": "gsettings set a b c"}}])) is None
    assert static_column(task(result={"type": "vm_terminal_output"})) is None
    assert static_column(task(result={"type": "vscode_config"}))[0] == "vscode"
    assert static_column(task(result={"type": "vscode_config"}), vscode_missing=None) is None  # installed: run
    column, reason = static_column(task(result={"type": "active_url_from_accessTree"}), a11y_missing="no pyatspi")
    assert column == "fails" and "/accessibility" in reason and "no pyatspi" in reason
    assert static_column(task(result={"type": "active_url_from_accessTree"}), a11y_missing=None) is None  # served: run
    tree = {"type": "accessibility_tree"}
    assert "uri:deskat" in static_column(task(result=tree, func="check_left_panel"))[1]  # OSWorld's VM cannot either
    rules = {"type": "rule", "rules": [{"selectors": ["page-tab-list[attr|id=\"tabmail-tabs\"]>page-tab"]}]}
    assert static_column(task(result=tree, func="check_accessibility_tree", expected=rules)) is None
    assert static_column(task([{"type": "launch", "parameters": {"command": ["vlc"]}}])) is None  # to be run
    rows = [{"task": "a" * 36, "domain": "os", "column": "scores", "reason": "no-op 0", "solvable": "yes",
             "setup_failures": ["activate_window \"Terminal\": no window matched 'Terminal'"]},
            {"task": "b" * 36, "domain": "os", "column": "download", "reason": "1 file", "solvable": "network"}]
    table = markdown(rows)
    assert "| os | 2 | 1 | 1 | 0 | 0 | 0 |" in table and "**Solvable here: 1 feasible task files over 1 domains**" in table
    assert "| `aaaaaaaa` | os | scores | no-op 0 | yes | activate_window \"Terminal\": no window matched" in table


def test_the_census_names_a_set_up_that_passed_only_because_the_host_had_the_package():
    """`sudo apt-get install sysstat` succeeds in the sandbox (which installs nothing) because the
    host has sysstat: the census names such steps, as it names failed ones."""
    from arpo_lib.envs.osworld.sandbox_census import dpkg_installed, markdown, preinstalled

    task = {"config": [{"type": "command", "parameters": {"command": "echo password | sudo -S apt-get update && "
                                                                    "echo password | sudo -S apt-get install -y sysstat jq"}},
                       {"type": "execute", "parameters": {"command": ["bash", "-c", "sudo apt install xsel && xsel -bc"]}},
                       {"type": "execute", "parameters": {"command": "apt install not-here"}}]}
    have = {"sysstat", "jq", "xsel"}
    named = preinstalled(task, have.__contains__)
    assert len(named) == 2 and "sysstat, jq" in named[0] and "xsel" in named[1] and "passed only because" in named[0]
    assert preinstalled(task, lambda p: False) == []
    assert dpkg_installed("dpkg") and not dpkg_installed("no-such-package-here")
    row = {"task": "c" * 36, "domain": "multi_apps", "column": "scores", "reason": "no-op 0", "solvable": "not tried",
           "setup_failures": [], "preinstalled": named[:1]}
    assert "passed only because the host has sysstat, jq installed" in markdown([row])


def test_the_census_says_what_is_solvable_here_and_why_not():
    from arpo_lib.envs.osworld.sandbox_census import solvable
    from arpo_lib.envs.osworld.tasks import known_solutions, known_unsolvable

    feasible = {"evaluator": {"func": "exact_match"}}
    solved = next(iter(known_solutions()))
    assert solvable({"task": solved, "column": "scores"}, feasible) == "yes"
    assert solvable({"task": solved, "column": "internet"}, feasible) == "yes"  # solved offline all the same
    unsolvable, why = next(iter(known_unsolvable().items()))
    assert solvable({"task": unsolvable, "column": "scores"}, feasible) == f"no: {why}"
    assert solvable({"task": "x", "column": "fails", "reason": "needs systemd"}, feasible) == "no: needs systemd"
    assert solvable({"task": "x", "column": "vscode", "reason": "code"}, feasible).startswith("no: needs VS Code")
    assert solvable({"task": "x", "column": "download", "reason": ""}, feasible) == "network"
    assert solvable({"task": "x", "column": "scores"}, {"evaluator": {"func": "infeasible"}}) == "FAIL"
    assert solvable({"task": "x", "column": "scores"}, feasible) == "not tried"
    assert not set(known_solutions()) & set(known_unsolvable())  # one judgement per task


# ---- with OSWorld's desktop_env ----------------------------------------------------------------

@pytest.fixture(scope="module")
def task_files(tmp_path_factory) -> list[Path]:
    """The test tasks, their download URLs pointing at files served on this machine's loopback (the
    set-up's `download` step fetches on the host, then uploads into the sandbox)."""
    served = tmp_path_factory.mktemp("served")
    (served / "report.txt").write_text("the quarterly figures\n")
    handler = functools.partial(_QuietHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    out = tmp_path_factory.mktemp("tasks")
    files = []
    for path in sorted(TASKS.glob("*.json")):
        text = path.read_text().replace("{FILES}", f"http://127.0.0.1:{server.server_port}")
        (out / path.name).write_text(text)
        files.append(out / path.name)
    yield files
    server.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def _in_osworld(python: str, args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([python, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _result(python: str, script: str, *args: str) -> dict:
    """Run `script` in OSWorld's interpreter and return what it printed on its `RESULT <json>` line."""
    done = _in_osworld(python, ["-c", script, *args])
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_osworlds_own_evaluator_scores_the_sandbox_no_op_zero_and_solution_one(osworld_python, task_files):
    done = _in_osworld(osworld_python, ["-m", "arpo_lib.envs.osworld.sandbox_check",
                                        f"--screen={SCREEN[0]}x{SCREEN[1]}", *map(str, task_files)])
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"task"')]
    assert [(r["task"], r["noop"], r["solved"], r["errors"]) for r in results] == [
        ("arpo-sandbox-editor-save", 0.0, 1.0, []), ("arpo-sandbox-terminal-archive", 0.0, 1.0, [])], \
        done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0


_HOSTILE = r"""
import json, sys
from desktop_sandbox.osworld import SandboxDesktopEnv
from desktop_sandbox import a11y as served
task = json.load(open(sys.argv[1]))
a11y = None
if served.unavailable():
    try:
        SandboxDesktopEnv(action_space="pyautogui", require_a11y_tree=True)
    except ValueError as e:
        a11y = str(e)
env = SandboxDesktopEnv(action_space="pyautogui", screen_size=(1280, 800), cache_dir=sys.argv[2],
                        require_a11y_tree=served.unavailable() is None)
try:
    obs = env.reset(task_config=task)
    out = {"tree": (obs["accessibility_tree"] or "")[:14]}
    for name, code in [("os.system", "import os; os.system('touch /home/user/pwned')"),
                       ("hidden in a click", "pyautogui.click(5, 5); __import__('os').system('touch /home/user/pwned')"),
                       ("open", "open('/home/user/pwned', 'w').write('x')")]:
        out[name] = env.step(code, pause=0)[3].get("action_error")
    out["clicked"] = env.step("import pyautogui\npyautogui.click(640, 400)", pause=0)[3].get("action_error")
    out["pwned"] = env.sandbox.execute("ls -a /home/user", shell=True)["output"].split()
    out["platform"] = env.controller.get_vm_platform()  # a getter's probe still goes to /execute
    out["score"] = env.evaluate()
    out["a11y"] = a11y
    print("RESULT " + json.dumps(out))
finally:
    env.close()
"""


@pytest.mark.slow
def test_the_agents_code_through_osworlds_step_is_checked(osworld_python, task_files, tmp_path):
    """OSWorld's step sends the agent's pyautogui code to the server to run; on the sandbox it goes
    through the workbench's check first: code outside the action space never runs."""
    out = _result(osworld_python, _HOSTILE, str(task_files[0]), str(tmp_path))
    for name in ("os.system", "hidden in a click", "open"):
        assert out[name] and "allowed" in out[name], (name, out)
    assert out["clicked"] is None and "pwned" not in out["pwned"]
    assert out["platform"] == "Linux" and out["score"] == 0.0
    if a11y.unavailable():
        assert "cannot serve the accessibility tree" in out["a11y"] and out["tree"] == ""
    else:  # OSWorld's controller fetched the tree into the observation
        assert out["tree"] == "<desktop-frame"


@pytest.mark.slow
def test_an_osworld_episode_on_the_sandbox_in_an_environment_worker(osworld_python, task_files, tmp_path):
    """The workbench's own path: make_env("osworld/<id>") options with provider "sandbox", in an
    environment worker process on the OSWorld interpreter (as env.python=auto runs them)."""
    task = json.loads(task_files[0].read_text())
    options = {"provider": "sandbox", "task_config": task, "screen_size": list(SCREEN), "pause_s": 0.3,
               "cache_root": str(tmp_path / "cache"), "download_cache": None, "max_steps": 5}
    with EnvPool(1, options, timeout_s=300, python=osworld_python) as pool:
        worker = pool.workers[0]
        obs, info = worker.call("reset", (f"osworld/{task['id']}", 0))
        assert obs.screenshot.size == SCREEN and info["task_id"] == task["id"]
        result = None
        for action in solution_actions(task, SCREEN):
            result = worker.call("step", action_payload([action]))
        _, reward, terminated, _, info = result
        assert (reward, terminated, info["score"]) == (1.0, True, 1.0), info
        worker.call("reset", (f"osworld/{task['id']}", 1))
        _, reward, terminated, _, info = worker.call("step", action_payload([Action("finished")]))
        assert (reward, terminated) == (0.0, True)


_EPISODE = r"""
import json, sys, time
from arpo_lib.actions import Action
from arpo_lib.envs.base import EnvError
from arpo_lib.envs.osworld.env import OSWorldEnv
task = json.load(open(sys.argv[1]))
env = OSWorldEnv(task, provider="sandbox", screen_size=(1280, 800), pause_s=0.3, cache_root=sys.argv[2],
                 download_cache=None, max_steps=5)
out = {}
"""
"""The start of a script in OSWorld's interpreter: an episode of the task file argv[1] on the GNOME
sandbox (argv[2]: its cache root), and `out`, which the script prints on its RESULT line."""
_CRASH = _EPISODE + r"""
try:
    env.reset()
    env.step(Action("click", point=(640, 400)))
    box = env.desktop_env.sandbox
    (editor,) = [a for a in box.launched() if a["command"][0] == "mousepad"]
    box.execute(f"kill -SEGV {editor['pid']}", shell=True)  # as a crash ends it
    time.sleep(1.0)
    try:
        env.step(Action("click", point=(640, 400)))
    except EnvError as e:
        out["raised"] = str(e)
    env.reset()  # the next episode: its own editor, nothing reported
    out["next"] = env.step(Action("click", point=(640, 400)))[4]["action_error"]
    box = env.desktop_env.sandbox
    (editor,) = [a for a in box.launched() if a["command"][0] == "mousepad"]
    box.execute(f"kill -TERM {editor['pid']}", shell=True)  # as the agent's `pkill mousepad` ends it
    time.sleep(1.0)
    out["quit"] = env.step(Action("click", point=(640, 400)))[4]["action_error"]
finally:
    env.close()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_the_tasks_application_crashing_mid_episode_is_the_environments_failure(osworld_python, task_files,
                                                                                tmp_path):
    """The editor the task's set-up launched dies of SIGSEGV mid-episode: the next step raises
    EnvError naming it (the episode is the environment's failure, dropped from its group, never
    scored 0 as the model's); the next episode has its own editor and no report; an editor the
    agent's own `pkill` ends (SIGTERM) is the agent's doing and is not reported."""
    out = _result(osworld_python, _CRASH, str(task_files[0]), str(tmp_path))
    assert "a program the episode needs crashed" in out["raised"] and "mousepad" in out["raised"], out
    assert "SIGSEGV" in out["raised"] and out["next"] is None and out["quit"] is None, out


_TYPED = r"""
import json, sys, time
from arpo_lib.actions import Action
from arpo_lib.envs.osworld.env import FOCUS_PROBE, OSWorldEnv
ascii_line = "".join(chr(c) for c in range(0x20, 0x7f))
other_line = sys.argv[3]
task = json.load(open(sys.argv[1]))
env = OSWorldEnv(task, provider="sandbox", screen_size=(1280, 800), pause_s=0.5, cache_root=sys.argv[2],
                 download_cache=None, max_steps=20)
out = {}
try:
    env.reset()  # notes.txt open in the text editor, focused
    out["editor_focus"] = env.desktop_env.controller.execute_python_command(FOCUS_PROBE)["output"]
    for text in (ascii_line + "\n", other_line + "\n"):
        out.setdefault("editor_errors", []).append(env.step(Action("type", text=text))[4]["action_error"])
    env.step(Action("hotkey", keys=["ctrl", "s"]))
    time.sleep(1.0)
    box = env.desktop_env.sandbox
    out["editor"] = (box.read_file("/home/user/notes.txt") or b"").decode()
    env.step(Action("hotkey", keys=["ctrl", "alt", "t"]))
    deadline = time.monotonic() + 20
    while not any("@" in w["title"] for w in box.windows()) and time.monotonic() < deadline:
        time.sleep(0.3)
    time.sleep(1.0)
    out["terminal_focus"] = env.desktop_env.controller.execute_python_command(FOCUS_PROBE)["output"]
    out["terminal_codes"] = []
    for text in ("set +H; cat > ~/typed.txt <<'END'\n", ascii_line + "\n", other_line + "\n", "END\n"):
        info = env.step(Action("type", text=text))[4]
        out["terminal_codes"].append(info["code"])
    deadline = time.monotonic() + 20
    while box.read_file("/home/user/typed.txt") is None and time.monotonic() < deadline:
        time.sleep(0.3)
    time.sleep(1.0)
    out["terminal"] = (box.read_file("/home/user/typed.txt") or b"").decode()
finally:
    env.close()
print("RESULT " + json.dumps(out))
"""
OTHER_TEXT = "café naïve Straße — “quoted” € 日本語 Ελληνικά"
"""Text pyautogui cannot type on X11 (it is pasted): accents, typographic punctuation, CJK, Greek."""


@pytest.mark.slow
def test_the_agents_text_arrives_as_written_in_a_text_field_and_in_a_terminal(osworld_python, task_files, tmp_path):
    """Through OSWorld's DesktopEnv on the GNOME sandbox: every printable ASCII character (`<`
    included, which pyautogui alone types as `>`) and text outside ASCII (pasted) arrive unchanged
    in the text editor and in GNOME Terminal. The focus probe tells a terminal from a text field: in
    the terminal the paste is ctrl+shift+v (its ctrl+v is the shell's quoted-insert, and the
    pasted text was lost), in the editor ctrl+v."""
    out = _result(osworld_python, _TYPED, str(task_files[0]), str(tmp_path), OTHER_TEXT)
    printable = "".join(chr(c) for c in range(0x20, 0x7f))
    assert "mousepad" in out["editor_focus"].lower() and "gnome-terminal" in out["terminal_focus"], out
    assert out["editor_errors"] == [None, None], out
    assert out["editor"] == f"{printable}\n{OTHER_TEXT}\n", out["editor"]
    assert "pyautogui.hotkey('ctrl', 'shift', 'v')" in out["terminal_codes"][2], out["terminal_codes"]
    assert out["terminal"] == f"{printable}\n{OTHER_TEXT}\n", out["terminal"]


_SHELL_GONE = _EPISODE + r"""
try:
    env.reset()
    env.step(Action("click", point=(640, 400)))
    env.desktop_env.sandbox.execute("pkill -KILL -x gnome-shell", shell=True)  # the desktop's shell dies
    time.sleep(2.0)
    try:
        env.step(Action("click", point=(640, 400)))
    except EnvError as e:
        out["raised"] = str(e)
    out["next"] = env.reset()[1]["setup_failures"]  # a fresh desktop
finally:
    env.close()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_a_desktop_whose_shell_died_is_the_environments_failure(osworld_python, task_files, tmp_path):
    """GNOME Shell dying mid-episode (SIGKILL, as the out-of-memory killer ends it) leaves the
    editor's window unmanaged on a black desktop: the next step raises EnvError naming the
    desktop's shell, and the next reset gives a working desktop."""
    out = _result(osworld_python, _SHELL_GONE, str(task_files[0]), str(tmp_path))
    assert "the desktop's gnome-shell" in out["raised"] and "SIGKILL" in out["raised"], out
    assert out["next"] == [], out


_PRESTART = r"""
import json, os, sys, time
from arpo_lib.actions import Action
from arpo_lib.envs.osworld.env import OSWorldEnv
task = json.load(open(sys.argv[1]))
env = OSWorldEnv(task, provider="sandbox", screen_size=(1280, 800), pause_s=0.3, cache_root=sys.argv[2],
                 download_cache=None, max_steps=5, prestart=True)
out = {"episodes": []}
try:
    for episode in range(3):
        info = env.reset()[1]
        box = env.desktop_env.sandbox
        out["episodes"].append({"server_pid": box.process.pid, "timings": info.get("reset_timings"),
                                "marker": box.read_file("/home/user/Desktop/marker.txt") is not None,
                                "editors": [a["command"][0] for a in box.launched()]})
        box.execute("echo mine > ~/Desktop/marker.txt", shell=True)
        env.step(Action("type", text="episode %d" % episode))
    provider = env.desktop_env.provider
    pids = [e["server_pid"] for e in out["episodes"]]
finally:
    env.close()
time.sleep(1.0)
out["alive_after_close"] = [p for p in set(pids) if os.path.exists("/proc/%d" % p)]
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_a_prestarted_desktop_is_handed_over_fresh_at_each_reset(osworld_python, task_files, tmp_path):
    """prestart: the reset hands over a second sandbox made ready during the episode, and the one
    just used is reset meanwhile for the episode after: the sandboxes alternate, each episode starts
    with an empty home (the last episode's file is gone) and only its own set-up's editor; the
    reset's info splits its time into the desktop's part and the task's set-up; closing the
    environment ends both sandboxes."""
    out = _result(osworld_python, _PRESTART, str(task_files[0]), str(tmp_path))
    first, second, third = out["episodes"]
    assert first["server_pid"] != second["server_pid"] and third["server_pid"] == first["server_pid"], out
    assert [e["marker"] for e in out["episodes"]] == [False, False, False], out
    assert all(e["editors"] == ["mousepad"] for e in out["episodes"]), out
    assert second["timings"]["handed_over"] and third["timings"]["handed_over"], out
    assert set(second["timings"]) == {"reset_s", "desktop_s", "setup_s", "settle_s", "handed_over"}, out
    assert out["alive_after_close"] == [], out


def test_the_borrowed_torch_follows_the_checkout_that_borrows_it(osworld_python, tmp_path):
    """Regression (a CI run): the tests' OSWorld environment borrows torch from the checkout that
    built it, by a path in a .pth file; that environment is cached across checkouts, and a CI clone in
    a removed temporary folder left it pointing nowhere ("No module named 'torch'") while its packages
    were up to date. setup_osworld.sh now rewrites the path on every run."""
    if os.environ.get("ARPO_OSWORLD_PYTHON"):
        pytest.skip("an OSWorld interpreter given by $ARPO_OSWORLD_PYTHON is not the tests' own environment")
    import sysconfig

    site = subprocess.run([osworld_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    pth = Path(site) / "zz-arpo-borrowed-torch.pth"
    assert pth.read_text().strip() == sysconfig.get_paths()["purelib"]
    pth.write_text(str(tmp_path / "gone" / "site-packages") + "\n")  # a checkout that was removed
    env = {**os.environ, "ARPO_OSWORLD_VENV": str(Path(osworld_python).parents[1]),
           "ARPO_OSWORLD_TORCH_FROM": sysconfig.get_paths()["purelib"]}
    done = subprocess.run(["bash", str(REPO / "scripts" / "setup_osworld.sh"), "--light", "--desktop-env=pypi"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "packages up to date" in done.stdout + done.stderr  # no reinstall: only the path was rewritten
    assert pth.read_text().strip() == sysconfig.get_paths()["purelib"]
    subprocess.run([osworld_python, "-c", "import torch, desktop_env.desktop_env"], check=True, timeout=300)



BOMB = ("python3 -c \"import zipfile; z = zipfile.ZipFile('/home/user/report.docx', 'w', zipfile.ZIP_DEFLATED); "
        "f = z.open('[Content_Types].xml', 'w', force_zip64=True); [f.write(b' ' * 2**24) for _ in range(192)]; "
        "f.close(); z.close()\" && exit\n")
"""What a hostile agent types into the terminal: a 3 MB .docx whose one part unpacks to 3 GiB; the
terminal closes when it is written."""


@pytest.mark.slow
def test_a_document_that_unpacks_to_gigabytes_costs_the_host_no_more_than_the_workers_limit(osworld_python,
                                                                                            tmp_path):
    """OSWorld's metrics parse what the agent saved on the host, in the environment worker: here
    `compare_docx_files` opens (python-docx, zipfile) a 3 MB document the agent made in the terminal,
    whose content-types part unpacks to 3 GiB. In a worker limited to 3 GiB the read fails there
    (MemoryError, which the metric turns into a 0): the worker never holds more than its limit and
    serves the next episode. Before the limit, the host held all 3 GiB; a bigger document (or
    several workers) reached the OOM killer, whose choice would have been the trainer."""
    task = {
        "id": "arpo-sandbox-docx-bomb", "snapshot": "os", "related_apps": ["stterm"],
        "instruction": "Write the quarterly report into ~/report.docx.",
        "config": [{"type": "launch", "parameters": {"command": "stterm -t Terminal", "shell": False}},
                   {"type": "activate_window", "parameters": {"window_name": "Terminal", "strict": True}},
                   {"type": "sleep", "parameters": {"seconds": 1}}],
        "evaluator": {"func": "compare_docx_files",
                      "result": {"type": "vm_file", "path": "/home/user/report.docx", "dest": "report.docx"},
                      "expected": {"type": "vm_file", "path": "/home/user/report.docx", "dest": "gold.docx"}},
    }
    # openbox: the terminal's end is seen as a screen of one colour (GNOME's has its top bar and dock)
    options = {"provider": "sandbox", "task_config": task, "screen_size": list(SCREEN), "pause_s": 0.5,
               "cache_root": str(tmp_path / "cache"), "download_cache": None, "max_steps": 400, "desktop": "openbox"}
    with EnvPool(1, options, timeout_s=300, python=osworld_python, memory_mib=3072) as pool:
        worker = pool.workers[0]
        before = worker.call("ping")
        assert before["memory_limit_mib"] == 3072, before
        worker.call("reset", (f"osworld/{task['id']}", 0))
        obs = worker.call("step", action_payload([Action("type", text=BOMB)]))[0]
        for _ in range(300):  # the terminal's python writes 3 GiB through zlib (~15 s here), then exits
            if obs.screenshot.getcolors(1) is not None:
                break  # one colour, the desktop's background: the terminal has closed
            obs = worker.call("step", action_payload([Action("wait")]))[0]
        else:
            pytest.fail("the terminal never finished writing the document")
        ready = worker.call("ping")
        _, reward, terminated, _, info = worker.call("step", action_payload([Action("finished")]))
        after = worker.call("ping")
        assert (reward, terminated, info["score"]) == (0.0, True, 0.0), info
        assert after["pid"] == before["pid"], "the worker died instead of failing the check"
        # it did unpack (a truncated file would fail at once, costing nothing): the check took the
        # worker to a new peak, well above what it held before; and it held at most its limit
        # (the start-up peak, 1.0-2.0 GiB seen here, is far above what the worker holds after it)
        assert ready["peak_rss_mib"] < after["peak_rss_mib"] < 3072, (ready, after)
        assert ready["rss_mib"] + 256 < after["peak_rss_mib"], (ready, after)
        worker.call("reset", (f"osworld/{task['id']}", 1))  # the next episode is served as before


@pytest.mark.slow
def test_sandbox_check_reports_a_refused_task_file_and_goes_on(osworld_python, task_files, tmp_path):
    """A task file desktop_env refuses (a set-up step type it does not know) is reported on its line,
    at once (no boot retries), and the check goes on; --noop runs a file without a solution."""
    bad = json.loads(task_files[0].read_text())
    bad.update(id="arpo-refused", config=[{"type": "no_such_step", "parameters": {}}])
    bad.pop("x_solution", None)
    (tmp_path / "arpo-refused.json").write_text(json.dumps(bad))
    done = _in_osworld(osworld_python, ["-m", "arpo_lib.envs.osworld.sandbox_check", "--noop",
                                        f"--screen={SCREEN[0]}x{SCREEN[1]}", str(tmp_path / "arpo-refused.json"),
                                        str(task_files[0])])
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"task"')]
    assert [line["task"] for line in lines] == ["arpo-refused", "arpo-sandbox-editor-save"], done.stderr[-3000:]
    assert "refuses the task file: unknown set-up step type" in lines[0]["error"]
    assert lines[1]["error"] is None and lines[1]["noop"] == 0.0 and lines[1]["solved"] is None
    assert done.returncode == 1  # not every file passed


_LOOK_FOR_THE_CHECKERS = r'''
import json, os, desktop_env
from desktop_sandbox.sandbox import Sandbox
source = os.path.dirname(desktop_env.__file__)
box = Sandbox((800, 600))
try:
    said = {name: box.execute(command, shell=True, timeout=120)["output"] for name, command in {
        "import": "python3 -c 'import desktop_env' 2>&1; python -c 'import desktop_env.evaluators.metrics' 2>&1",
        "path": f"ls {source}/evaluators/metrics 2>&1; ls {os.path.dirname(source)} 2>&1",
        "find": "find / -path /proc -prune -o \\( -name 'desktop_env*' -o -name 'table.py' -path '*metrics*' \\) -print 2>/dev/null",
        "sys.path": "python3 -c 'import sys; print(sys.path)'",
        "mounts": "cat /proc/self/mountinfo; tr '\\0' ' ' < /proc/1/cmdline",
    }.items()}
finally:
    box.close()
print(json.dumps({"source": source, "said": said}))
'''


@pytest.mark.slow
def test_the_agent_cannot_read_the_checkers_it_is_scored_by(osworld_python):
    """The sandbox started from OSWorld's interpreter (where desktop_env's evaluators are installed):
    inside, desktop_env cannot be imported, its directory is not there, a search of the whole file
    system finds none of it, and neither the interpreter's path nor the mounts name the host's
    environment (the sandbox's Python is the staged one, runtime.py)."""
    done = _in_osworld(osworld_python, ["-c", _LOOK_FOR_THE_CHECKERS], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    said, source = found["said"], found["source"]
    assert said["import"].count("No module named 'desktop_env'") == 2, said["import"]
    assert "No such file or directory" in said["path"] and "table.py" not in said["path"], said["path"]
    assert said["find"].strip() == "", said["find"]
    environment = str(Path(source).parents[3])  # the venv holding lib/pythonX.Y/site-packages/desktop_env
    assert environment not in said["sys.path"] and environment not in said["mounts"], said
    assert "/opt/arpo/site" in said["sys.path"]
