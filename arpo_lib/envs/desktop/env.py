"""`desktop/<task>`: a real X desktop in a sandbox (sandbox.py), the suite's task set up in it
(tasks.py), the agent's actions executed as the same pyautogui code OSWorld runs, and the task's
checker reading the state left behind.

One sandbox serves every episode of an environment: `reset` ends every application, re-creates
the home directory empty and runs the task's set-up; a dead sandbox is replaced at the next reset.
A sandbox that fails or stops answering is an infrastructure failure (EnvError), never a score.
"""
from __future__ import annotations

import functools
import io
import shutil
import time
from collections.abc import Callable
from typing import Any

from PIL import Image

from arpo_lib.actions import PASTE_KEYS, Action, ActionParseError, paste_keys_for, pastes, to_pyautogui
from arpo_lib.envs.base import EnvError, GUIEnv, Observation
from arpo_lib.envs.desktop import tasks as suite
from desktop_sandbox.confinement import ISOLATION_MODES, Limits
from desktop_sandbox.gnome import DESKTOP_KINDS
from desktop_sandbox.sandbox import Sandbox, SandboxError, network_mode
from desktop_sandbox.superuser import sudo_mode


def _sandbox_failures_as_env_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """The sandbox's own failures (SandboxError) are this contract's infrastructure failures (EnvError)."""
    @functools.wraps(method)
    def wrapper(self: DesktopEnv, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except SandboxError as e:
            raise EnvError(f"{self.name}: {e}") from e
    return wrapper


class DesktopEnv(GUIEnv):
    """One task of the desktop suite. Options: `screen` (width, height), `max_steps`, `settle_s`
    (pause after each action before the screenshot), `wait_s` (what a `wait()` action waits),
    `limits` (the sandbox's resource limits: confinement.Limits fields), `isolation` ("auto",
    "namespaces" or "user": confinement.py), `desktop` ("openbox", the suite's own: no launcher;
    or "gnome", OSWorld's VM's: gnome.py), `network` ("none"; "user": usernet.py), `sudo` ("user":
    sudo checks the VM's password and gives no privilege; "root": real root inside the sandbox over
    a writable system layer a reset throws away: superuser.py)."""

    def __init__(self, task: str, *, screen: tuple[int, int] = (1920, 1080), max_steps: int = 15,
                 settle_s: float = 0.5, wait_s: float = 1.0, reward: str = "binary",
                 limits: Limits | dict[str, Any] | None = None, isolation: str = "auto",
                 desktop: str = "openbox", network: str = "none", sudo: str = "user") -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"isolation must be one of {ISOLATION_MODES}, got {isolation!r}")
        if desktop not in DESKTOP_KINDS:
            raise ValueError(f"desktop must be one of {DESKTOP_KINDS}, got {desktop!r}")
        self.limits = Limits.from_options(limits)  # an unknown or impossible limit fails here, not at reset
        self.isolation = isolation
        self.desktop = desktop
        self.network = network_mode(network)
        self.sudo = sudo_mode(sudo)
        if self.sudo == "root" and isolation == "user":
            raise ValueError("sudo='root' gives root inside a namespaces sandbox: it cannot run with isolation='user'")
        self.task = suite.load_task(task)
        absent = [c for c in suite.required_commands(self.task) if not shutil.which(c)]
        if absent:
            raise EnvError(f"desktop/{task} needs {', '.join(absent)}, which is not installed "
                           "(./workbench setup installs the suite's applications)")
        self.name = f"desktop/{task}"
        self.screen = (int(screen[0]), int(screen[1]))
        self.max_steps, self.settle_s, self.wait_s = max_steps, settle_s, wait_s
        self.reward_mode = reward
        self._box: Sandbox | None = None
        self._steps = 0
        self._episode_over = True
        self._closed = False
        self.timings: dict[str, float] = {}
        """Seconds of the last sandbox start, reset (set-up included) and step."""

    @property
    def instruction(self) -> str:
        return str(self.task["instruction"])

    @property
    def sandbox(self) -> Sandbox:
        if self._box is None:
            raise RuntimeError(f"{self.name}: no sandbox yet (call reset)")
        return self._box

    @_sandbox_failures_as_env_errors
    def reset(self, seed: int | None = None) -> tuple[Observation, dict[str, Any]]:
        """A fresh episode (the suite's tasks have one instance: `seed` changes nothing)."""
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        t0 = time.monotonic()
        if self._box is None or not self._box.alive():
            if self._box is not None:
                self._box.close()
            self._box = Sandbox(self.screen, limits=self.limits, isolation=self.isolation,
                                window_manager=self.desktop, network=self.network, sudo=self.sudo)
            self.timings["start_s"] = time.monotonic() - t0
        try:
            self._box.reset_session()
            suite.run_setup(self._box, self.task["config"])
            time.sleep(self.settle_s)
            screen = self._screenshot()
        except (EnvError, SandboxError):
            self._box.close()
            self._box = None
            raise
        self.timings["reset_s"] = time.monotonic() - t0
        self._steps, self._episode_over = 0, False
        return Observation(screen, self.instruction, 0), {"raw_reward": 0.0, "action_error": None}

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")

    @_sandbox_failures_as_env_errors
    def _step(self, action: Action) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        t0 = time.monotonic()
        error = None
        try:
            # the keys that paste depend on the focused window: a terminal's are ctrl+shift+v
            keys = paste_keys_for(self.sandbox.active_window().get("wm_class")) if pastes(action) else PASTE_KEYS
            code = to_pyautogui(action, self.screen, paste_keys=keys)
        except ActionParseError as e:  # e.g. a key pyautogui lacks: the action does nothing
            code, error = "", str(e)
        terminated = code in ("DONE", "FAIL")
        if code == "WAIT":
            time.sleep(self.wait_s)
        elif code and not terminated:
            done = self.sandbox.run_action(code)
            if done.get("status") == "refused":  # to_pyautogui's output is always accepted
                raise EnvError(f"{self.name}: the action server refused generated code: {done['error']}")
            if done.get("returncode") != 0:
                error = (done.get("error") or "")[-300:] or f"exit {done.get('returncode')}"
            if done.get("crashed"):  # the task's application died of a crash: the machine's failure
                self._episode_over = True
                raise EnvError(f"{self.name}: a program the episode needs crashed: {'; '.join(done['crashed'])[:500]}")
            if done.get("incidents"):  # the sandbox ended the episode's programs (a limit was crossed)
                error = "; ".join(done["incidents"])[-300:]
            time.sleep(self.settle_s)
        truncated = not terminated and self._steps >= self.max_steps
        reward = raw = 0.0
        if terminated or truncated:
            self._episode_over = True
            raw = suite.evaluate(self.sandbox, self.task["evaluator"])
            reward = raw if self.reward_mode == "raw" else float(raw > 0)
        screen = self._screenshot()
        self.timings["step_s"] = time.monotonic() - t0
        return (Observation(screen, self.instruction, self._steps), reward, terminated, truncated,
                {"raw_reward": raw, "action_error": error})

    def _screenshot(self) -> Image.Image:
        return Image.open(io.BytesIO(self.sandbox.screenshot())).convert("RGB")

    def close(self) -> None:
        self._closed = True
        if self._box is not None:
            self._box.close()
            self._box = None
