"""Environment workers in another interpreter (`EnvWorker(python=...)`), as OSWorld needs.

The other interpreter is a small venv with miniwob but NO torch, built once and cached under
~/.cache/arpo-workbench/test-venv-envworker/ (rebuilt when broken). Real MiniWoB episodes run
through it; the worker proves which interpreter serves it with the `ping` command.
"""
from __future__ import annotations

import hashlib
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from arpo_lib.actions import Action
from arpo_lib.envs.base import EnvError
from arpo_lib.envs.workers.pool import EnvPool
from arpo_lib.envs.workers.worker import EnvSetupError, EnvWorker, action_payload

VENV = Path.home() / ".cache" / "arpo-workbench" / "test-venv-envworker"
CHECK = "import miniwob, selenium, PIL, importlib.util as u; assert u.find_spec('torch') is None"


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _works(venv: Path) -> bool:
    python = _venv_python(venv)
    return python.is_file() and subprocess.run([python, "-c", CHECK], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def other_python() -> str:
    """A torch-free venv with miniwob==1.1.0 (selenium, gymnasium, numpy, pillow)."""
    if not _works(VENV):
        shutil.rmtree(VENV, ignore_errors=True)
        try:
            subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", VENV],
                           check=True, capture_output=True, timeout=120)
            subprocess.run([_venv_python(VENV), "-m", "pip", "install", "-q", "miniwob==1.1.0"],
                           check=True, capture_output=True, timeout=600)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            shutil.rmtree(VENV, ignore_errors=True)
            output = (getattr(exc, "stderr", None) or b"").decode(errors="replace")
            pytest.skip(f"cannot build the test venv (offline?): {output[-500:]}")
        assert _works(VENV), "the test venv was built but cannot import miniwob (or has torch)"
    return str(_venv_python(VENV))


# ---- no browser, no venv ----------------------------------------------------------------------

def test_missing_interpreter_is_a_setup_error_naming_it():
    with pytest.raises(EnvSetupError, match="/nonexistent/bin/python.*does not exist"):
        EnvPool(1, {}, python="/nonexistent/bin/python")


def test_an_interpreter_that_cannot_start_the_worker_reports_its_output(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'arpo_lib'\" >&2\nexit 3\n")
    fake.chmod(0o755)
    start = time.monotonic()
    with pytest.raises(EnvSetupError, match=r"(?s)exited with code 3.*No module named 'arpo_lib'"):
        EnvWorker({}, timeout_s=10, python=str(fake))
    assert time.monotonic() - start < 10


def test_our_own_interpreter_keeps_the_spawn_path():
    worker = EnvWorker({}, timeout_s=30, python=sys.executable)
    try:
        assert worker.python is None and isinstance(worker.process, multiprocessing.process.BaseProcess)
        assert worker.call("ping")["executable"] == sys.executable
    finally:
        worker.close()


def test_a_worker_closed_while_an_episode_restarts_it_stays_closed():
    """An episode's thread restarts a worker whose pipe broke while the trainer's thread closes the
    pool (a batch playing ahead at a run's end). The close waits for the restart, then closes the
    worker the restart started: no process outlives the close. Before, the close ran between the
    restart's kill and its start, and the new worker process was left behind (or the close joined
    a process not yet started: "can only join a started process")."""
    import threading

    worker = EnvWorker({}, timeout_s=30)
    killed, real_kill, errors = threading.Event(), worker.kill, []

    def slow_first_kill() -> None:  # the window between the restart's kill and its start
        real_kill()
        if not killed.is_set():
            killed.set()
            time.sleep(1.0)

    worker.kill = slow_first_kill

    def restart() -> None:
        try:
            worker.restart()
        except Exception as exc:  # noqa: BLE001 (the test reports it)
            errors.append(exc)

    episode = threading.Thread(target=restart)
    episode.start()
    assert killed.wait(10)
    worker.close()
    episode.join(30)
    assert not episode.is_alive() and errors == []
    assert worker.restarts == 1 and not worker.process.is_alive(), "a worker process outlived the close"


# ---- plug-ins ----------------------------------------------------------------------------------

PLUGIN = "tests.plugins.example_plugin"


def test_local_workers_import_the_runs_plugins_before_making_an_environment():
    """The worker process starts with nothing imported: the plug-in's family exists there only
    because the worker imported the plug-in."""
    with EnvPool(1, {"max_steps": 2}, timeout_s=60, plugins=[PLUGIN]) as pool:
        worker = pool.workers[0]
        obs, info = worker.call("reset", ("example/click-box@3", 0))  # an instance: its own seed, 3
        x1, y1, x2, y2 = info["box"]
        _, reward, terminated, _, _ = worker.call("step", action_payload([Action("click", point=((x1 + x2) / 2,
                                                                                                 (y1 + y2) / 2))]))
        assert obs.instruction == "Click the red box." and reward == 1.0 and terminated
    with EnvPool(1, {}, timeout_s=60) as pool, pytest.raises(EnvSetupError, match="environment family 'example'"):
        pool.workers[0].call("reset", ("example/click-box", 0))


def test_a_plugin_the_worker_cannot_import_is_a_setup_error_naming_it():
    with EnvPool(1, {}, timeout_s=60, plugins=["tests.plugins.nope"]) as pool:
        with pytest.raises(EnvSetupError, match=r"plug-in 'tests\.plugins\.nope' cannot be imported"):
            pool.workers[0].call("reset", ("miniwob/click-test", 0))


TMP_PLUGIN = """
from PIL import Image
from arpo_lib.envs import EnvFamily, GUIEnv, Observation, register_family

class Blank(GUIEnv):
    def reset(self, seed=None):
        return Observation(Image.new("RGB", (28, 28)), "nothing to do"), {}
    def step(self, action):
        return Observation(Image.new("RGB", (28, 28)), "nothing to do", 1), 0.0, True, False, {}

register_family(EnvFamily("blank", lambda task, **options: Blank(), tasks=["nothing"]))
"""


def test_a_worker_in_another_interpreter_finds_a_plugin_from_outside_the_repository(tmp_path, monkeypatch):
    """That interpreter's path holds only arpo_lib's directory, plus the plug-ins' own."""
    (tmp_path / "arpo_test_blank_plugin.py").write_text(TMP_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    worker = EnvWorker({}, timeout_s=60, fresh_interpreter=True, plugins=["arpo_test_blank_plugin"])
    try:
        assert worker.python is not None  # the other-interpreter path
        assert str(tmp_path) in worker.call("ping")["sys_path"]
        obs, _ = worker.call("reset", ("blank/nothing", 0))
        assert obs.instruction == "nothing to do"
    finally:
        worker.close()


HOG_PLUGIN = """
import subprocess, sys
from PIL import Image
from arpo_lib.envs import EnvFamily, GUIEnv, Observation, register_family

class Hog(GUIEnv):
    # Each step allocates (and touches) `action.text` MiB here, as a metric parsing a file that
    # unpacks to that much would; "child" reports the limit a program the worker starts inherits.
    def reset(self, seed=None):
        return Observation(Image.new("RGB", (28, 28)), "hog"), {}

    def step(self, action):
        screen = Observation(Image.new("RGB", (28, 28)), "hog", 1)
        if action.text == "child":
            code = "import resource; print(resource.getrlimit(resource.RLIMIT_DATA))"
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
            return screen, 0.0, False, False, {"child": out}
        block = bytearray(int(action.text) * 2**20)
        block[::4096] = b"x" * len(block[::4096])
        return screen, 0.0, False, False, {"mib": len(block) >> 20}

register_family(EnvFamily("hog", lambda task, **options: Hog(), tasks=["eat"]))
"""


@pytest.mark.parametrize("fresh_interpreter", [False, True], ids=["spawn", "interpreter"])
def test_a_worker_cannot_take_the_hosts_memory_and_is_the_oom_killers_first_choice(tmp_path, monkeypatch,
                                                                                    fresh_interpreter):
    """The worker is where the host parses what a hostile agent made (OSWorld's metrics read its
    files): an allocation past `memory_mib` fails there as a MemoryError, an infrastructure failure
    of that episode; the worker lives on, and what it starts inherits the limit. Before, the
    allocation went through and only the host's memory bounded it; the kernel's OOM killer, when
    it came to that, would pick the largest process: the trainer."""
    (tmp_path / "arpo_test_hog_plugin.py").write_text(HOG_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    worker = EnvWorker({}, timeout_s=60, fresh_interpreter=fresh_interpreter, plugins=["arpo_test_hog_plugin"],
                       memory_mib=768)
    try:
        facts = worker.call("ping")
        assert facts["memory_limit_mib"] == 768 and facts["oom_score_adj"] == 1000
        assert Path("/proc/self/oom_score_adj").read_text().strip() != "1000"  # the trainer's side is as it was
        worker.call("reset", ("hog/eat", 0))
        assert worker.call("step", action_payload([Action("type", text="64")]))[4]["mib"] == 64
        with pytest.raises(EnvError, match="MemoryError"):
            worker.call("step", action_payload([Action("type", text="1024")]))
        assert worker.call("ping")["pid"] == facts["pid"] and worker.restarts == 0
        worker.call("reset", ("hog/eat", 0))
        child = worker.call("step", action_payload([Action("type", text="child")]))[4]["child"]
        assert child.startswith(f"({768 * 2**20}, ")
    finally:
        worker.close()


def test_the_worker_memory_limit_comes_from_the_config_and_is_checked():
    from arpo_lib import build
    from arpo_lib.envs.workers.worker import DEFAULT_MEMORY_MIB
    from arpo_lib.run.config import ConfigError

    assert build.load_config("configs/smoke.yaml").env.worker_memory_mib == DEFAULT_MEMORY_MIB
    assert build.load_config("configs/smoke.yaml", ["env.worker_memory_mib=null"]).env.worker_memory_mib is None
    for bad in ("100", "lots", "true"):
        with pytest.raises(ConfigError, match="^env.worker_memory_mib"):
            build.load_config("configs/smoke.yaml", [f"env.worker_memory_mib={bad}"])
    with pytest.raises(ValueError, match="memory_mib"):
        EnvWorker({}, timeout_s=5, memory_mib=12)
    worker = EnvWorker({}, timeout_s=60, memory_mib=None)
    try:
        facts = worker.call("ping")
        assert facts["oom_score_adj"] == 1000 and facts["memory_limit_mib"] is None  # the OOM killer's choice either way
    finally:
        worker.close()


# ---- the torch-free venv ----------------------------------------------------------------------

def test_worker_runs_in_the_other_interpreter_without_our_packages(other_python):
    with EnvPool(1, {}, timeout_s=30, python=other_python) as pool:
        facts = pool.workers[0].call("ping")
    assert facts["executable"] == other_python
    assert Path(facts["prefix"]) == VENV
    assert not facts["torch_importable"] and not facts["torch_loaded"]
    ours = {p for p in sys.path if "site-packages" in p}
    assert ours and not ours & set(facts["sys_path"]), "our venv's packages leaked into the worker"
    # The worker is a session leader: killing its group reaps what it started.
    assert facts["pgid"] == facts["pid"]


def test_timeout_kills_and_restarts_the_worker_in_the_same_interpreter(other_python):
    with EnvPool(1, {}, timeout_s=1.0, python=other_python) as pool:
        worker = pool.workers[0]
        first = worker.call("ping")["pid"]
        os.kill(first, signal.SIGSTOP)  # a hang: the worker never answers
        start = time.monotonic()
        with pytest.raises(EnvError, match="timed out after 1 s"):
            worker.call("ping")
        assert time.monotonic() - start < 5
        assert pool.restarts == 1 and _gone(first)
        again = worker.call("ping")
        assert again["pid"] != first and again["executable"] == other_python


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _click_center(info: dict, element_id: str) -> Action:
    (e,) = [e for e in info["dom_elements"] if e["id"] == element_id]
    return Action("click", point=(e["left"] + e["width"] / 2, e["top"] + e["height"] / 2))


@pytest.mark.slow
def test_real_miniwob_episode_matches_the_local_worker(other_python, chromium_available):
    """reset + a step in the torch-free venv give the same screens and score as our interpreter."""
    results = {}
    for backend, python in (("other", other_python), ("ours", None)):
        with EnvPool(1, {"scale": 2, "max_steps": 3}, timeout_s=60, python=python) as pool:
            worker = pool.workers[0]
            obs, info = worker.call("reset", ("miniwob/click-test", 5))
            assert obs.instruction == "Click the button." and obs.screenshot.size == (320, 420)
            click = action_payload([_click_center(info, "subbtn")])
            after, reward, terminated, truncated, _ = worker.call("step", click)
            results[backend] = (obs.instruction, hashlib.sha256(obs.screenshot.tobytes()).hexdigest(),
                                reward, terminated, truncated, hashlib.sha256(after.screenshot.tobytes()).hexdigest())
    assert results["other"][2:5] == (1.0, True, False)
    assert results["other"] == results["ours"]


@pytest.mark.slow
def test_killed_worker_is_an_env_error_and_its_browser_dies_with_it(other_python, chromium_available):
    with EnvPool(1, {"scale": 2, "max_steps": 3}, timeout_s=60, python=other_python) as pool:
        worker = pool.workers[0]
        worker.call("reset", ("miniwob/click-test", 0))
        old = worker.process.pid
        browsers = [p for p in psutil.Process(old).children(recursive=True) if "chrom" in p.name()]
        assert browsers
        os.kill(old, signal.SIGKILL)  # the worker alone: its browser is left to the group kill
        with pytest.raises(EnvError, match="worker (process died|connection lost|pipe broken)"):
            worker.call("step", action_payload([Action("click", point=(10.0, 10.0))]))
        assert pool.restarts == 1 and worker.process.pid != old
        _, live = psutil.wait_procs(browsers, timeout=5)
        assert all(p.status() == psutil.STATUS_ZOMBIE for p in live), "a browser outlived its worker"
        # The new worker is in the same interpreter and runs episodes.
        assert worker.call("ping")["executable"] == other_python
        obs, _ = worker.call("reset", ("miniwob/click-test", 1))
        assert obs.screenshot.size == (320, 420)


@pytest.mark.slow
def test_a_worker_killed_behind_its_pools_back_takes_its_browser_along(chromium_available):
    """What Ray's raylet does to a dead actor's children: the worker is SIGKILLed alone and its
    parent only reaps it (nobody calls kill or close). The browser and driver must still go."""
    with EnvPool(1, {"scale": 2, "max_steps": 3}, timeout_s=60) as pool:
        worker = pool.workers[0]
        worker.call("reset", ("miniwob/click-test", 0))
        pid = worker.process.pid
        browsers = [p for p in psutil.Process(pid).children(recursive=True) if "chrom" in p.name()]
        assert browsers
        os.kill(pid, signal.SIGKILL)
        worker.process.join(timeout=10)  # reaped, as any parent does
        _, live = psutil.wait_procs(browsers, timeout=10)
        assert all(p.status() == psutil.STATUS_ZOMBIE for p in live), f"{len(live)} browser processes outlived their worker"
