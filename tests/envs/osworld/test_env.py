"""OSWorld backend against the fake DesktopEnv (no Docker, no VM), and the fake against the real API.

The fake's signatures are compared with desktop-env 1.0.2's source (the wheel is downloaded once
from PyPI into the workbench cache and parsed, never imported) and, where an interpreter with
desktop_env exists, with the installed class through inspect.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import socket
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from arpo_lib.actions import Action, to_pyautogui
from arpo_lib.envs import EnvError, list_envs, make_env
from arpo_lib.envs.osworld import env as osworld
from arpo_lib.envs.osworld import machine as osworld_machine
from arpo_lib.envs.osworld.env import (CONTAINER_FILE, OSWorldEnv, OSWorldSetupError, find_osworld_python, remove_stale_cache_dirs)
from arpo_lib.envs.osworld.downloads import DownloadCache
from arpo_lib.envs.osworld.fake import (BOOT_FAILURES_VAR, FAKE_DESKTOP_ENV, FAKE_TASK_LOADER, FakeDesktopEnv, load_fake_task)
from arpo_lib.envs.workers.pool import EnvPool
from arpo_lib.envs.workers.worker import EnvSetupError, _is_setup_error, action_payload

REPO = Path(__file__).resolve().parents[3]
ADAPTER_METHODS = ("__init__", "reset", "step", "evaluate", "close")
"""The DesktopEnv methods OSWorldEnv calls: the fake must match them exactly."""
BOX_CENTRE = (960, 540)  # inside fake-click's target box [860, 500, 1060, 580]


@pytest.fixture(autouse=True)
def _fresh_fake():
    FakeDesktopEnv.clear()
    yield
    FakeDesktopEnv.clear()


def fake_env(tmp_path: Path, task: str | dict[str, Any] = "fake-click", **options: Any) -> OSWorldEnv:
    config = load_fake_task(task) if isinstance(task, str) else task
    options = {"provider": "fake", "desktop_env_class": FakeDesktopEnv, "cache_root": tmp_path / "cache",
               "download_cache": tmp_path / "downloads", "pause_s": 0, "backoff_s": 0, **options}
    return OSWorldEnv(config, **options)


def with_faults(task: str = "fake-click", **faults: Any) -> dict[str, Any]:
    config = load_fake_task(task)
    config["fake"] = faults
    return config


def calls(method: str, instance: int | None = None) -> list:
    return [c for c in FakeDesktopEnv.calls if c.method == method and instance in (None, c.instance)]


# ---- the fake has the real class's signatures ---------------------------------------------

def _real_desktop_env_source() -> str:
    """desktop_env/desktop_env.py of desktop-env 1.0.2, from its wheel (downloaded once, cached)."""
    cache = osworld.workbench_cache() / "osworld-sdist"
    wheels = sorted(cache.glob("desktop_env-1.0.2-*.whl"))
    if not wheels:
        try:
            result = subprocess.run(
                [sys.executable, "-m", "pip", "download", "desktop-env==1.0.2", "--no-deps",
                 "--only-binary=:all:", "-d", str(cache)], capture_output=True, text=True, timeout=300)
            detail = result.stderr[-300:]
        except (OSError, subprocess.TimeoutExpired) as e:
            detail = str(e)
        wheels = sorted(cache.glob("desktop_env-1.0.2-*.whl"))
        if not wheels:
            pytest.skip(f"cannot download desktop-env 1.0.2 from PyPI: {detail}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        return wheel.read("desktop_env/desktop_env.py").decode()


def _ast_signatures(source: str, class_name: str) -> dict[str, list[tuple[str, str, str | None]]]:
    """method -> [(parameter, kind, default as source text)] of a class, read with ast."""
    cls = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == class_name)
    signatures = {}
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef) or fn.name not in ADAPTER_METHODS:
            continue
        a = fn.args
        positional = a.posonlyargs + a.args
        defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
        params = [(p.arg, "positional", ast.unparse(d) if d else None) for p, d in zip(positional, defaults)]
        if a.vararg:
            params.append((a.vararg.arg, "*args", None))
        params += [(p.arg, "keyword", ast.unparse(d) if d else None) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
        if a.kwarg:
            params.append((a.kwarg.arg, "**kwargs", None))
        signatures[fn.name] = params
    return signatures


def test_fake_signatures_equal_desktop_env_1_0_2_source():
    real = _ast_signatures(_real_desktop_env_source(), "DesktopEnv")
    fake = _ast_signatures(Path(sys.modules[FakeDesktopEnv.__module__].__file__).read_text(), "FakeDesktopEnv")
    assert set(real) == set(ADAPTER_METHODS), "desktop-env 1.0.2 lacks a method the adapter calls"
    for method in ADAPTER_METHODS:
        assert fake[method] == real[method], method
    # What the adapter passes exists in the real signatures.
    init = [p[0] for p in real["__init__"]]
    assert set(osworld._MANAGED_KWARGS) <= set(init)
    assert [p[0] for p in real["reset"]][:2] == ["self", "task_config"] and "pause" in [p[0] for p in real["step"]]


_INSPECT_SCRIPT = """
import inspect, json, sys
from desktop_env.desktop_env import DesktopEnv
print(json.dumps({m: [[p.name, str(p.kind), repr(p.default)]
                      for p in inspect.signature(getattr(DesktopEnv, m)).parameters.values()]
                  for m in sys.argv[1:]}))
"""


@pytest.mark.slow
def test_fake_signatures_equal_installed_desktop_env(osworld_python):
    """The fake's signatures are desktop-env's own, read in the OSWorld interpreter the tests build."""
    import inspect

    python = osworld_python
    result = subprocess.run([python, "-c", _INSPECT_SCRIPT, *ADAPTER_METHODS], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    real = json.loads(result.stdout.strip().splitlines()[-1])
    fake = {m: [[p.name, str(p.kind), repr(p.default)]
                for p in inspect.signature(getattr(FakeDesktopEnv, m)).parameters.values()]
            for m in ADAPTER_METHODS}
    assert fake == real


_LESS_THAN_FIX = """
import json, sys
from desktop_env.desktop_env import _fix_pyautogui_less_than_bug
print(json.dumps([_fix_pyautogui_less_than_bug(code) for code in json.loads(sys.stdin.read())]))
"""


def test_desktop_envs_less_than_fix_leaves_our_typing_alone_and_never_reaches_arpos(osworld_python):
    """desktop_env's step rewrites the code it runs (`_fix_pyautogui_less_than_bug`). Our code for
    a text with `<` holds no `<` for it to rewrite (each is shift+comma already), so it runs as
    made; ARPO's `pyautogui.write('a<b')` does not match the fix either (it rewrites `typewrite`),
    so on the VM its `<` arrives as `>`, as docs/faithful-to-arpo.md says."""
    ours = to_pyautogui(Action("type", text="wc -l < in.txt\n"))
    arpos = to_pyautogui(Action("type", text="a<b", rules="arpo"))
    typewrite = "import pyautogui\npyautogui.typewrite('a<b')"
    done = subprocess.run([osworld_python, "-c", _LESS_THAN_FIX], input=json.dumps([ours, arpos, typewrite]),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    fixed = json.loads(done.stdout.strip().splitlines()[-1])
    assert fixed[0] == ours and "<" not in ours
    assert fixed[1] == arpos and "'a<b'" in arpos
    assert fixed[2] != typewrite and "<" not in fixed[2]  # the fix does act, on typewrite


def test_modules_import_without_heavy_dependencies():
    # importing the package registers the family (its folder's __init__), not its environment
    code = ("import sys, arpo_lib.envs; assert 'arpo_lib.envs.osworld' in sys.modules; "
            "assert not {'arpo_lib.envs.osworld.env', 'arpo_lib.envs.osworld.fake'} & set(sys.modules); "
            "import arpo_lib.envs.osworld.env, arpo_lib.envs.osworld.fake; "
            "heavy = {'torch', 'transformers', 'desktop_env', 'docker', 'gymnasium', 'numpy'} & set(sys.modules); "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# ---- the adapter's contract ---------------------------------------------------------------

def test_reset_boots_lazily_and_returns_the_screen(tmp_path):
    env = fake_env(tmp_path)
    assert FakeDesktopEnv.instances == []  # nothing boots before the first reset
    obs, info = env.reset(seed=3)
    assert isinstance(obs.screenshot, Image.Image) and obs.screenshot.mode == "RGB"
    assert obs.screenshot.size == (1920, 1080)
    assert obs.instruction == "Click the blue 'Submit' button." and obs.step == 0
    assert info == {"task_id": "fake-click", "domain": "fake", "setup_failures": []}
    assert env.name == "osworld/fake-click"
    (init,) = calls("__init__")
    assert init.args == {
        "provider_name": "fake", "region": None, "path_to_vm": None, "snapshot_name": "init_state",
        "action_space": "pyautogui", "cache_dir": str(env.cache_dir), "screen_size": (1920, 1080),
        "headless": True, "require_a11y_tree": False, "require_terminal": False, "os_type": "Ubuntu",
        "enable_proxy": False, "client_password": ""}
    (reset,) = calls("reset")
    assert reset.args["task_config"]["id"] == "fake-click" and reset.args["seed"] == 3
    env.close()


@pytest.mark.parametrize("action", [
    Action("click", point=(100.4, 200.6)),
    Action("click", point=(5000, -20)),  # clipped into the 1280x720 screen
    Action("left_double", point=(10, 10)),
    Action("right_single", point=(640, 360)),
    Action("drag", point=(10, 10), end_point=(300, 400)),
    Action("hotkey", keys=["ctrl", "c"]),
    Action("type", text="it's \"quoted\"\n"),
    Action("scroll", point=(50, 60), direction="left"),
], ids=lambda a: a.kind)
def test_step_sends_exactly_the_converted_code(tmp_path, action):
    env = fake_env(tmp_path, screen_size=[1280, 720], max_steps=5)  # a YAML list is accepted
    env.reset()
    obs, reward, terminated, truncated, info = env.step(action)
    expected = to_pyautogui(action, (1280, 720))
    assert calls("step")[-1].args == {"action": expected, "pause": 0.0}
    assert info["code"] == expected and info["action_error"] is None
    assert (reward, terminated, truncated) == (0.0, False, False) and obs.step == 1
    assert obs.screenshot.size == (1280, 720)
    assert calls("evaluate") == []
    env.close()


@pytest.mark.parametrize("kind, code, ends", [("wait", "WAIT", False), ("finished", "DONE", True),
                                               ("call_user", "FAIL", True)])
def test_special_actions(tmp_path, kind, code, ends):
    env = fake_env(tmp_path)
    env.reset()
    _, reward, terminated, truncated, info = env.step(Action(kind))
    assert calls("step")[-1].args["action"] == code and info["code"] == code
    assert terminated is ends and truncated is False
    assert len(calls("evaluate")) == int(ends)
    if ends:
        assert info["score"] == reward == 0.0  # feasible task, nothing clicked
    env.close()


def test_scripted_success_scores_one_and_a_miss_zero(tmp_path):
    env = fake_env(tmp_path)
    env.reset()
    assert env.step(Action("click", point=BOX_CENTRE))[1:4] == (0.0, False, False)
    _, reward, terminated, _, info = env.step(Action("finished", text="done"))
    assert (reward, terminated, info["score"]) == (1.0, True, 1.0)
    with pytest.raises(RuntimeError, match="call reset"):
        env.step(Action("wait"))
    env.reset()  # same VM, new episode
    env.step(Action("click", point=(10, 10)))
    assert env.step(Action("finished"))[1] == 0.0
    assert len(FakeDesktopEnv.instances) == 1
    env.close()


def test_typing_task_and_infeasible_task(tmp_path):
    env = fake_env(tmp_path, "fake-type")
    env.reset()
    env.step(Action("type", text="hello world\n"))
    assert env.step(Action("finished"))[1] == 1.0
    env.close()
    env = fake_env(tmp_path, "fake-infeasible")
    env.reset()
    assert env.step(Action("call_user"))[1] == 1.0  # OSWorld: infeasible scores 1 only after FAIL
    env.reset()
    assert env.step(Action("finished"))[1] == 0.0
    env.close()


def test_truncation_is_scored_too(tmp_path):
    env = fake_env(tmp_path, max_steps=3)
    env.reset()
    env.step(Action("click", point=BOX_CENTRE))
    assert env.step(Action("wait"))[1:4] == (0.0, False, False)
    _, reward, terminated, truncated, info = env.step(Action("wait"))
    assert (reward, terminated, truncated, info["score"]) == (1.0, False, True, 1.0)
    assert len(calls("evaluate")) == 1
    env.close()


def test_refused_action_is_a_noop_step(tmp_path):
    env = fake_env(tmp_path)
    env.reset()
    obs, reward, terminated, truncated, info = env.step(Action("hotkey", keys=["hyperdrive"]))
    assert info["code"] is None and "hyperdrive" in info["action_error"]
    assert calls("step") == [] and obs.step == 1 and not (terminated or truncated)
    env.close()


def test_typing_without_a_clipboard_in_the_vm_types_the_ascii_part_and_says_so(tmp_path):
    """A VM without xclip or xsel: pasting blind would stop at the copy (exit 1, stderr sent to
    /dev/null), losing the whole text and its Enter unnoticed. The VM is asked once; the ASCII
    part and the Enter are typed; info names what was lost."""
    env = fake_env(tmp_path, with_faults("fake-type", clipboard=False), pause_vm=False)
    env.reset()
    desktop = env.desktop_env
    desktop.step(to_pyautogui(Action("type", text="hello wörld\n")))  # what pasting blind does
    assert desktop.typed == ""
    _, _, _, _, info = env.step(Action("type", text="hello wörld\n"))
    assert desktop.typed == "hello wrld\n"
    assert info["code"] == to_pyautogui(Action("type", text="hello wörld\n"), clipboard=False)
    assert "no clipboard tool" in info["action_error"] and "'ö'" in info["action_error"]
    assert env.step(Action("type", text="plain\n"))[4]["action_error"] is None  # ASCII needs no clipboard
    _, _, _, _, info = env.step(Action("type", text="ü"))
    assert "'ü'" in info["action_error"]
    assert sum("determine_clipboard" in c for c in desktop.controller.commands) == 1  # asked once
    env.close()


def test_with_a_clipboard_in_the_vm_text_is_pasted_whole(tmp_path):
    env = fake_env(tmp_path, "fake-type")
    env.reset()
    _, _, _, _, info = env.step(Action("type", text="hello wörld\n"))
    assert env.desktop_env.typed == "hello wörld\n" and info["action_error"] is None
    assert "pyperclip.copy('hello wörld')" in info["code"]
    env.close()


def test_text_pasted_into_a_terminal_uses_the_terminals_paste(tmp_path):
    """The focused window is asked before a paste: in a terminal the paste is ctrl+shift+v (its
    ctrl+v is the shell's quoted-insert: the fake, like GNOME Terminal, pastes nothing on it), in
    a text field ctrl+v. ASCII text types without asking."""
    env = fake_env(tmp_path, with_faults("fake-type", focused="gnome-terminal-server.Gnome-terminal"), pause_vm=False)
    env.reset()
    desktop = env.desktop_env
    desktop.step(to_pyautogui(Action("type", text="wörld")))  # a text field's paste, in a terminal
    assert desktop.typed == ""
    _, _, _, _, info = env.step(Action("type", text="hello wörld\n"))
    assert desktop.typed == "hello wörld\n" and info["action_error"] is None
    assert "pyautogui.hotkey('ctrl', 'shift', 'v')" in info["code"]
    probes = [c for c in desktop.controller.commands if "_NET_ACTIVE_WINDOW" in c]
    env.step(Action("type", text="plain"))
    assert len([c for c in desktop.controller.commands if "_NET_ACTIVE_WINDOW" in c]) == len(probes) == 1
    env.close()

    env = fake_env(tmp_path, with_faults("fake-type", focused="mousepad.Mousepad"), pause_vm=False)
    env.reset()
    info = env.step(Action("type", text="hello wörld"))[4]
    assert env.desktop_env.typed == "hello wörld" and "pyautogui.hotkey('ctrl', 'v')" in info["code"]
    env.close()


def test_every_actions_error_reaches_the_step_info(tmp_path):
    """A response of several actions: each action's error is kept, not only the last one's."""
    from arpo_lib.envs.workers.worker import step_actions

    env = fake_env(tmp_path, with_faults("fake-type", clipboard=False))
    env.reset()
    payload = action_payload([Action("type", text="é"), Action("hotkey", keys=["hyperdrive"]), Action("wait")])
    info = step_actions(env, payload)[4]
    assert "'é'" in info["action_error"] and "hyperdrive" in info["action_error"]
    env.close()


def test_the_clipboard_probe_asks_pyperclip(tmp_path):
    """CLIPBOARD_PROBE, run for real (no X server needed: pyperclip only looks for the tools): a
    PATH without xclip and xsel says False, one with an xclip says True."""
    tools = tmp_path / "bin"
    tools.mkdir()
    def probe(path: str) -> str:
        env = {"PATH": path, "DISPLAY": ":99", "HOME": str(tmp_path)}
        done = subprocess.run([sys.executable, "-c", osworld.CLIPBOARD_PROBE], env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()
    assert probe(str(tools)) == "clipboard: False"
    (tools / "xclip").write_text("#!/bin/sh\nexit 0\n")
    (tools / "xclip").chmod(0o755)
    assert probe(str(tools)) == "clipboard: True"


def test_accessibility_tree_on_request(tmp_path):
    env = fake_env(tmp_path, require_a11y_tree=True)
    _, info = env.reset()
    assert "Submit" in info["accessibility_tree"]
    assert calls("__init__")[0].args["require_a11y_tree"] is True
    assert "accessibility_tree" in env.step(Action("wait"))[4]
    env.close()


def test_each_env_has_its_own_cache_dir_removed_on_close(tmp_path):
    a, b = fake_env(tmp_path), fake_env(tmp_path)
    a.reset()
    b.reset()
    assert a.cache_dir != b.cache_dir and a.cache_dir.parent == b.cache_dir.parent == tmp_path / "cache"
    assert [c.args["cache_dir"] for c in calls("__init__")] == [str(a.cache_dir), str(b.cache_dir)]
    assert (a.cache_dir / "fake-click").is_dir()  # DesktopEnv's per-task subdir, inside ours
    a.close()
    a.close()  # safe twice
    assert not a.cache_dir.exists() and b.cache_dir.exists()
    assert len(calls("close", 0)) == 1 and FakeDesktopEnv.instances[0].closed
    with pytest.raises(RuntimeError, match="closed"):
        a.reset()
    b.close()


def test_container_record_survives_only_a_failed_close(tmp_path):
    class DockerLike(FakeDesktopEnv):
        fail_close = False

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.provider = types.SimpleNamespace(container=types.SimpleNamespace(id="c0ffee"))

        def close(self):
            super().close()
            if self.fail_close:
                raise ConnectionError("docker daemon gone")

    env = fake_env(tmp_path, desktop_env_class=DockerLike)
    env.reset()
    assert (env.cache_dir / CONTAINER_FILE).read_text() == "c0ffee"
    env.close()
    assert not env.cache_dir.exists()
    env = fake_env(tmp_path, desktop_env_class=DockerLike)
    env.reset()
    DockerLike.fail_close = True
    env.close()
    assert (env.cache_dir / CONTAINER_FILE).read_text() == "c0ffee"  # kept for the janitor


# ---- boots, retries, infrastructure failures ------------------------------------------------

def test_failed_setups_are_retried_with_exponential_backoff(tmp_path, monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr(osworld.time, "sleep", sleeps.append)
    env = fake_env(tmp_path, with_faults(reset_failures=2), boot_retries=3, backoff_s=10)
    obs, _ = env.reset()
    assert obs.instruction and sleeps == [10, 20]
    assert len(FakeDesktopEnv.instances) == 3  # a fresh DesktopEnv after each failure
    assert [i.closed for i in FakeDesktopEnv.instances] == [True, True, False]
    env.close()


def test_boot_gives_up_with_env_error(tmp_path, monkeypatch):
    monkeypatch.setenv(BOOT_FAILURES_VAR, "5")  # the constructor (VM boot) fails
    env = fake_env(tmp_path, boot_retries=2)
    with pytest.raises(EnvError, match="3 attempts.*failed to boot") as err:
        env.reset()
    assert not _is_setup_error(err.value)
    monkeypatch.setenv(BOOT_FAILURES_VAR, "0")
    assert env.reset()[0].step == 0  # the next reset tries again
    env.close()


@pytest.mark.parametrize("mode", ["raise", "no_screenshot"])
def test_vm_death_mid_episode_is_an_infrastructure_failure(tmp_path, mode):
    env = fake_env(tmp_path, with_faults(die_at_step=2, die_mode=mode))
    env.reset()
    env.step(Action("click", point=(5, 5)))
    with pytest.raises(EnvError) as err:
        env.step(Action("click", point=(6, 6)))
    assert not _is_setup_error(err.value)
    assert env.desktop_env is None and FakeDesktopEnv.instances[0].closed
    with pytest.raises(RuntimeError, match="call reset"):
        env.step(Action("wait"))
    obs, _ = env.reset()  # a fresh VM
    assert len(FakeDesktopEnv.instances) == 2 and obs.step == 0
    assert env.step(Action("wait"))[0].step == 1
    env.close()


def test_a_screen_of_one_colour_is_the_environments_failure_not_the_models(tmp_path):
    """A blanked, locked or disconnected VM screen (ARPO's VMs locked during slow training steps)
    is not a screen the agent can act on: the step raises EnvError saying so and the next reset
    boots a fresh VM; at reset it is a failed boot, retried."""
    env = fake_env(tmp_path, with_faults(blank_at_step=2))
    env.reset()
    env.step(Action("click", point=(5, 5)))
    with pytest.raises(EnvError, match=r"the screen is one colour, rgb\(0, 0, 0\)") as err:
        env.step(Action("click", point=(6, 6)))
    assert not _is_setup_error(err.value) and env.desktop_env is None
    env.close()
    env = fake_env(tmp_path, with_faults(blank_at_step=0), boot_retries=1)
    with pytest.raises(EnvError, match="2 attempts") as err:
        env.reset()
    assert "one colour" in str(err.value)
    env.close()


def test_a_locked_vm_screen_is_the_environments_failure_not_the_models(tmp_path):
    """GNOME's lock screen came up while the model thought (ARPO's maintainers name VMs that
    locked during slow training steps as a cause of a failed reproduction): the VM is asked before
    each action, the action is not typed into the lock screen, and the step raises EnvError saying
    so (the episode is dropped from its group, never scored 0); the next reset boots a fresh VM."""
    env = fake_env(tmp_path, with_faults(locked_at_step=1), pause_vm=False)
    env.reset()
    env.step(Action("click", point=(5, 5)))
    desktop = env.desktop_env
    with pytest.raises(EnvError, match="the screen is locked") as err:
        env.step(Action("click", point=(6, 6)))
    assert not _is_setup_error(err.value) and env.desktop_env is None
    assert desktop.clicks == [(5, 5)]  # the second click never reached the lock screen
    assert sum("org.gnome.ScreenSaver" in c for c in desktop.controller.commands) == 2
    env.close()
    env = fake_env(tmp_path, with_faults(locked_at_step=1), pause_vm=False, provider="sandbox")
    assert env.lock_check is False  # the sandbox has no lock screen (tests/desktop_sandbox/test_gnome.py)
    env.close()


@pytest.mark.parametrize("fault", ["evaluate_fails", "checker_raises"])
def test_a_checker_that_raises_scores_zero_and_is_reported(tmp_path, fault):
    """ARPO scores a checker exception 0; leaving such episodes out would bias success upward."""
    env = fake_env(tmp_path, with_faults(**{fault: True}))
    env.reset()
    _, reward, terminated, _, info = env.step(Action("finished"))
    assert terminated and reward == 0.0 and info["score"] == 0.0
    assert info["checker_error"].startswith(("ConnectionError", "KeyError"))
    assert env.desktop_env is not None  # the VM is fine: the next episode reuses it
    env.close()


def test_the_vm_is_paused_while_the_model_thinks(tmp_path):
    env = fake_env(tmp_path)
    env.reset()
    vm = env.desktop_env
    assert vm.paused  # after reset: the model looks at the first screen
    env.step(Action("wait"))
    assert vm.paused
    order = [c.method for c in FakeDesktopEnv.calls if c.method in ("reset", "step", "pause", "unpause", "evaluate")]
    assert order == ["reset", "pause", "unpause", "step", "pause"]
    env.step(Action("finished"))  # the fake refuses step/evaluate on a paused VM
    assert not vm.paused and [c.method for c in FakeDesktopEnv.calls][-3:] == ["unpause", "step", "evaluate"]
    env.reset()
    assert vm.paused
    env.close()


def test_a_desktop_env_without_pause_is_driven_as_before(tmp_path):
    class OldDesktopEnv(FakeDesktopEnv):
        pause = unpause = None  # desktop-env 1.0.2 has neither

    env = fake_env(tmp_path, desktop_env_class=OldDesktopEnv)
    env.reset()
    assert env.step(Action("finished"))[2]
    env.close()


DOWNLOADING = {"id": "fake-download", "snapshot": "fake", "domain": "fake", "instruction": "Open the report.",
               "config": [{"type": "download", "parameters": {"files": [
                   {"url": "https://example.org/files/report.docx", "path": "/home/user/report.docx"}]}}],
               "evaluator": {"func": "fake_typed_text", "result": {"type": "fake"}, "expected": {"text": "x"}}}


def test_a_machine_downloads_each_file_once(tmp_path):
    """Every environment keeps its own VM state and cache_dir, but set-up downloads come from one
    cache per machine: the second environment (and every later reset) finds the file."""
    first = fake_env(tmp_path, DOWNLOADING)
    first.reset()
    assert FakeDesktopEnv.downloads == ["https://example.org/files/report.docx"]
    first.close()
    second = fake_env(tmp_path, DOWNLOADING)
    second.reset()
    second.reset()
    assert FakeDesktopEnv.downloads == ["https://example.org/files/report.docx"]  # not again
    cache = DownloadCache(tmp_path / "downloads")
    (name,) = cache.index()
    assert cache.verify(name) and cache.index()[name]["tasks"] == ["fake-download"]
    second.close()
    off = fake_env(tmp_path, DOWNLOADING, download_cache=None)
    off.reset()
    assert len(FakeDesktopEnv.downloads) == 2  # without the shared cache: downloaded again
    off.close()


def test_wrong_screen_size_is_a_setup_error_not_retried(tmp_path):
    class SmallScreen(FakeDesktopEnv):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.screen_width, self.screen_height = 1280, 720

    env = fake_env(tmp_path, desktop_env_class=SmallScreen, boot_retries=3)
    with pytest.raises(OSWorldSetupError, match="1280x720 but screen_size is 1920x1080"):
        env.reset()
    assert len(FakeDesktopEnv.instances) == 1
    env.close()


def test_rejected_desktop_env_options_are_setup_errors(tmp_path):
    env = fake_env(tmp_path, desktop_env_kwargs={"snapshot_name": "clean"})
    env.reset()
    assert calls("__init__")[0].args["snapshot_name"] == "clean"
    env.close()
    env = fake_env(tmp_path, desktop_env_kwargs={"no_such_option": 1}, boot_retries=3)
    with pytest.raises(OSWorldSetupError, match="no_such_option") as err:
        env.reset()
    assert _is_setup_error(err.value) and len(FakeDesktopEnv.instances) == 1
    env.close()
    with pytest.raises(ValueError, match="screen_size"):
        fake_env(tmp_path, desktop_env_kwargs={"screen_size": (10, 10)})


# ---- preflight and installation errors ------------------------------------------------------

def _docker_module(ping_error: Exception | None = None, image: bool = True,
                   removed: list[str] | None = None) -> types.ModuleType:
    """A stand-in for the docker package: from_env().ping()/images.get()/containers.get().remove()."""
    module = types.ModuleType("docker")
    module.errors = types.SimpleNamespace(ImageNotFound=type("ImageNotFound", (Exception,), {}),
                                          NotFound=type("NotFound", (Exception,), {}))

    def get_image(name: str) -> object:
        if not image:
            raise module.errors.ImageNotFound(name)
        return object()

    def get_container(cid: str) -> object:
        return types.SimpleNamespace(remove=lambda force: removed.append(cid))

    def ping() -> bool:
        if ping_error:
            raise ping_error
        return True

    client = types.SimpleNamespace(ping=ping, images=types.SimpleNamespace(get=get_image),
                                   containers=types.SimpleNamespace(get=get_container), close=lambda: None)
    module.from_env = lambda: client
    return module


@pytest.fixture
def docker_host(tmp_path, monkeypatch):
    """A machine where the Docker provider could run: docker package and engine, /dev/kvm, VM disk."""
    monkeypatch.setitem(sys.modules, "docker", _docker_module())
    kvm = tmp_path / "kvm"
    kvm.touch()
    monkeypatch.setattr(osworld_machine, "KVM_DEVICE", str(kvm))
    vm = tmp_path / "Ubuntu.qcow2"
    vm.touch()
    monkeypatch.setenv("ARPO_OSWORLD_VM", str(vm))
    return types.SimpleNamespace(kvm=kvm, vm=vm)


def test_preflight_passes_and_resolves_the_vm_image(tmp_path, docker_host):
    env = fake_env(tmp_path, provider="docker")
    env.reset()
    assert calls("__init__")[0].args["path_to_vm"] == str(docker_host.vm.resolve())
    env.close()


@pytest.mark.parametrize("problem, error, message", [
    ("no_package", ImportError, r"docker.*package is missing.*setup_osworld\.sh"),
    ("no_engine", OSWorldSetupError, r"Docker engine is not usable.*Connection refused"),
    ("no_image", OSWorldSetupError, r"docker pull happysixd/osworld-docker"),
    ("no_kvm", OSWorldSetupError, r"/kvm does not exist.*allow_no_kvm=True"),
    ("no_vm", OSWorldSetupError, r"VM disk image .* does not exist.*setup_osworld\.sh --vm"),
])
def test_preflight_errors_are_clear_setup_errors(tmp_path, monkeypatch, docker_host, problem, error, message):
    if problem == "no_package":
        monkeypatch.setitem(sys.modules, "docker", None)
    elif problem == "no_engine":
        monkeypatch.setitem(sys.modules, "docker", _docker_module(ping_error=ConnectionError("Connection refused")))
    elif problem == "no_image":
        monkeypatch.setitem(sys.modules, "docker", _docker_module(image=False))
    elif problem == "no_kvm":
        docker_host.kvm.unlink()
    else:
        docker_host.vm.unlink()
    with pytest.raises(error, match=message) as err:
        fake_env(tmp_path, provider="docker")
    assert _is_setup_error(err.value)
    assert FakeDesktopEnv.instances == [] and not (tmp_path / "cache").exists()  # nothing started


def test_allow_no_kvm_warns_instead(tmp_path, docker_host):
    docker_host.kvm.unlink()
    with pytest.warns(UserWarning, match="kvm does not exist"):
        env = fake_env(tmp_path, provider="docker", allow_no_kvm=True)
    env.close()


def test_missing_desktop_env_names_the_setup_script(tmp_path):
    if importlib.util.find_spec("desktop_env") is not None:
        pytest.skip("desktop_env is installed in this interpreter")
    with pytest.raises(ImportError, match=r"setup_osworld\.sh.*FakeDesktopEnv") as err:
        OSWorldEnv(load_fake_task("fake-click"), provider="fake", cache_root=tmp_path)
    assert _is_setup_error(err.value)


def test_stale_cache_dirs_of_dead_processes_are_cleaned(tmp_path, monkeypatch):
    removed: list[str] = []
    monkeypatch.setitem(sys.modules, "docker", _docker_module(removed=removed))
    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname()
    root = tmp_path / "cache"
    stale = root / f"{host}-{dead.pid}-abc"
    live = root / f"{host}-{os.getpid()}-def"
    elsewhere = root / f"otherhost-{dead.pid}-ghi"
    for d in (stale, live, elsewhere):
        d.mkdir(parents=True)
    (stale / CONTAINER_FILE).write_text("deadbeef")
    env = fake_env(tmp_path)  # building an environment cleans up
    assert removed == ["deadbeef"] and not stale.exists() and live.exists() and elsewhere.exists()
    env.close()
    stale.mkdir()
    (stale / CONTAINER_FILE).write_text("deadbeef")
    monkeypatch.setitem(sys.modules, "docker", None)  # cannot remove the container: keep the record
    assert remove_stale_cache_dirs(root) == [] and stale.exists()


# ---- options, tasks, registry ---------------------------------------------------------------

def test_task_configs_are_checked(tmp_path):
    with pytest.raises(ValueError, match="lacks evaluator"):
        fake_env(tmp_path, {"id": "x", "instruction": "do"})
    with pytest.raises(ValueError, match="returned task 'fake-type' for 'fake-click'"):
        OSWorldEnv("fake-click", provider="fake", desktop_env_class=FAKE_DESKTOP_ENV, cache_root=tmp_path,
                   task_loader=lambda _: load_fake_task("fake-type"))
    with pytest.raises(FileNotFoundError, match="no fake OSWorld task 'nope'"):
        OSWorldEnv("nope", provider="fake", desktop_env_class=FAKE_DESKTOP_ENV, task_loader=FAKE_TASK_LOADER,
                   cache_root=tmp_path)
    with pytest.raises(ValueError, match="module:name"):
        OSWorldEnv("fake-click", provider="fake", task_loader="no_colon", cache_root=tmp_path)
    with pytest.raises(ImportError, match="has no 'nothing'"):
        OSWorldEnv("fake-click", provider="fake", task_loader="arpo_lib.envs.osworld_fake:nothing",
                   cache_root=tmp_path)
    with pytest.raises(ValueError, match="max_steps"):
        fake_env(tmp_path, max_steps=0)


def test_make_env_with_a_loader_a_function_or_a_task_config(tmp_path):
    assert list_envs("osworld")  # the registry can list the family (ids once the data is fetched)
    common = {"provider": "fake", "desktop_env_class": FAKE_DESKTOP_ENV, "cache_root": str(tmp_path),
              "pause_s": 0}
    for options in ({"task_loader": FAKE_TASK_LOADER}, {"task_loader": load_fake_task},
                    {"task_config": load_fake_task("fake-click")}):
        env = make_env("osworld/fake-click", **common, **options)
        assert isinstance(env, OSWorldEnv) and env.task_id == "fake-click"
        env.reset()
        env.step(Action("click", point=BOX_CENTRE))
        assert env.step(Action("finished"))[1] == 1.0
        env.close()
    with pytest.raises(ValueError, match="task_config is task 'fake-type'"):
        make_env("osworld/fake-click", **common, task_config=load_fake_task("fake-type"))


def test_find_osworld_python(tmp_path, monkeypatch):
    monkeypatch.delenv("ARPO_OSWORLD_PYTHON", raising=False)
    monkeypatch.setenv("ARPO_OSWORLD_VENV", str(tmp_path / "venv"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert find_osworld_python() is None
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    assert find_osworld_python() == str(python)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "desktop_env" else None)
    assert find_osworld_python() == sys.executable
    monkeypatch.setenv("ARPO_OSWORLD_PYTHON", "/opt/osworld/bin/python")
    assert find_osworld_python() == "/opt/osworld/bin/python"


def test_setup_script_is_valid_bash_and_pins_desktop_env():
    script = REPO / "scripts" / "setup_osworld.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert 'DESKTOP_ENV_VERSION="1.0.2"' in text and "venv-osworld" in text
    bad = subprocess.run(["bash", str(script), "--no-such-flag"], capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown argument" in bad.stderr


# ---- through the real environment worker processes ------------------------------------------

def _worker_options(tmp_path: Path, **faults: Any) -> dict[str, Any]:
    config = with_faults(log=str(tmp_path / "calls.jsonl"), **faults)
    return {"desktop_env_class": FAKE_DESKTOP_ENV, "provider": "fake", "task_config": config,
            "cache_root": str(tmp_path / "cache"), "pause_s": 0, "backoff_s": 0}


def _logged(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]


def test_worker_runs_an_episode_and_reports_infrastructure_failures(tmp_path):
    click, done = Action("click", point=BOX_CENTRE), Action("finished")
    with EnvPool(1, _worker_options(tmp_path, die_at_step=3), timeout_s=60) as pool:
        worker = pool.workers[0]
        obs, info = worker.call("reset", ("osworld/fake-click", 0))
        assert obs.screenshot.size == (1920, 1080) and info["task_id"] == "fake-click"
        _, reward, terminated, _, info = worker.call("step", action_payload([click, done]))
        assert (reward, terminated, info["score"]) == (1.0, True, 1.0)
        worker.call("reset", ("osworld/fake-click", 1))
        worker.call("step", action_payload([click, click]))
        with pytest.raises(EnvError, match="the VM failed during step"):  # not a set-up error
            worker.call("step", action_payload([click]))
        obs, _ = worker.call("reset", ("osworld/fake-click", 2))  # a fresh environment
        assert obs.step == 0 and worker.restarts == 0
    log = _logged(tmp_path)
    steps = [c["args"]["action"] for c in log if c["method"] == "step"]
    assert steps[:2] == [to_pyautogui(click), "DONE"]
    assert [c["result"] for c in log if c["method"] == "evaluate"] == [1.0]
    assert sorted({c["instance"] for c in log if c["method"] == "__init__"}) == [0, 1]


@pytest.mark.slow
def test_worker_hang_and_setup_errors(tmp_path):
    with EnvPool(1, _worker_options(tmp_path, hang_at_step=1, hang_s=120), timeout_s=3) as pool:
        pool.workers[0].call("reset", ("osworld/fake-click", 0))
        with pytest.raises(EnvError, match="timed out"):
            pool.workers[0].call("step", action_payload([Action("wait")]))
        assert pool.restarts == 1
    options = {"desktop_env_class": FAKE_DESKTOP_ENV, "provider": "fake", "task_loader": FAKE_TASK_LOADER,
               "cache_root": str(tmp_path / "cache")}
    with EnvPool(1, options, timeout_s=60) as pool:
        with pytest.raises(EnvSetupError, match="no-such-task"):
            pool.workers[0].call("reset", ("osworld/no-such-task", 0))


@pytest.mark.slow
def test_worker_in_the_osworld_interpreter(tmp_path, osworld_python):
    """In desktop-env's own interpreter (the one the tests build): the backend imports there without
    torch, an episode with the fake runs in a worker on that interpreter, and the real DesktopEnv is
    imported and its refusal of an unknown provider becomes a set-up error."""
    python = osworld_python
    assert os.path.abspath(python) != os.path.abspath(sys.executable)
    with EnvPool(1, _worker_options(tmp_path), timeout_s=120, python=python) as pool:
        worker = pool.workers[0]
        worker.call("reset", ("osworld/fake-click", 0))
        result = worker.call("step", action_payload([Action("click", point=BOX_CENTRE), Action("finished")]))
        assert result[1] == 1.0
        facts = worker.call("ping")
        assert os.path.abspath(facts["executable"]) == os.path.abspath(python) and not facts["torch_loaded"]
    options = {"provider": "no-such-provider", "task_loader": FAKE_TASK_LOADER, "cache_root": str(tmp_path)}
    with EnvPool(1, options, timeout_s=300, python=python) as pool:
        with pytest.raises(EnvSetupError, match="DesktopEnv could not be created"):
            pool.workers[0].call("reset", ("osworld/fake-click", 0))


def test_default_loader_reads_the_fetched_task_data(tmp_path, monkeypatch):
    from arpo_lib.envs.osworld import tasks as osworld_tasks

    monkeypatch.setenv(osworld_tasks.ENV_VAR, str(tmp_path / "no-tasks"))
    with pytest.raises(FileNotFoundError, match="not fetched") as err:
        OSWorldEnv("fake-click", provider="fake", desktop_env_class=FAKE_DESKTOP_ENV, cache_root=tmp_path)
    assert _is_setup_error(err.value)
    task = load_fake_task("fake-click")
    del task["domain"]  # OSWorld's task files have none: it comes from the data's layout
    monkeypatch.setattr(osworld_tasks, "load_task", lambda task_id: dict(task))
    monkeypatch.setattr(osworld_tasks, "task_domain", lambda task_id: "chrome")
    env = OSWorldEnv("fake-click", provider="fake", desktop_env_class=FAKE_DESKTOP_ENV, cache_root=tmp_path,
                     pause_s=0)
    assert env.reset()[1] == {"task_id": "fake-click", "domain": "chrome", "setup_failures": []}
    env.close()


# ---- set-up failures: named, and what an episode does about them -----------------------------

@pytest.mark.parametrize("policy", ["run", "skip", "error"])
def test_a_failed_set_up_is_named_and_the_policy_decides(tmp_path, policy):
    """`on_setup_failure`: run plays the episode (the failures in the reset's info), skip ends it
    at once (info says setup_skipped; a step is refused), error stops the run (a ValueError:
    environment workers report it as a set-up error)."""
    failed = ["execute apt-get install sysstat: exited with code 100", "activate_window Terminal: no window"]
    env = fake_env(tmp_path, with_faults(setup_failures=failed), on_setup_failure=policy)
    try:
        if policy == "error":
            with pytest.raises(ValueError, match="the task's set-up failed") as raised:
                env.reset()
            assert "exited with code 100" in str(raised.value)
            return
        obs, info = env.reset()
        assert info["setup_failures"] == failed
        if policy == "run":
            assert "setup_skipped" not in info
            env.step(Action("click", point=BOX_CENTRE))
        else:
            assert info["setup_skipped"] is True
            with pytest.raises(RuntimeError, match="episode is over"):
                env.step(Action("click", point=BOX_CENTRE))
    finally:
        env.close()


def test_on_setup_failure_and_desktop_are_checked(tmp_path):
    with pytest.raises(ValueError, match="on_setup_failure must be one of"):
        fake_env(tmp_path, on_setup_failure="ignore")
    with pytest.raises(ValueError, match="desktop must be one of"):
        fake_env(tmp_path, desktop="kde")
    with pytest.raises(ValueError, match="provider='sandbox'"):
        fake_env(tmp_path, desktop="openbox")
    with pytest.raises(ValueError, match="provider='sandbox'"):
        fake_env(tmp_path, network="user")
    with pytest.raises(ValueError, match="provider='sandbox'"):
        fake_env(tmp_path, sudo="root")
    with pytest.raises(ValueError, match="sudo must be 'user' or 'root'"):
        fake_env(tmp_path, sudo="admin")


def test_a_task_file_desktop_env_refuses_is_not_retried(tmp_path):
    """A step type desktop_env does not know: a retry cannot help, so no boot loop (before: 4 boots
    and the back-off, ~85 s, then an EnvError as if the VM had failed)."""
    from arpo_lib.envs.osworld.env import OSWorldTaskFileError, _task_file_refused

    env = fake_env(tmp_path, with_faults(refuse_setup=True), backoff_s=30)
    try:
        with pytest.raises(OSWorldTaskFileError, match="refuses the task file: unknown set-up step type"):
            env.reset()
        assert len(calls("reset")) == 1
    finally:
        env.close()
    wrapped = Exception("Setup step 2 failed: _launch_setup - x")
    wrapped.__cause__ = TypeError("_launch_setup() got an unexpected keyword argument 'comand'")
    assert "parameter it does not take" in _task_file_refused(wrapped)
    assert _task_file_refused(ConnectionError("the VM is not up")) is None
