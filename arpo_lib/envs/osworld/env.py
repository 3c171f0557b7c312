"""OSWorld desktop tasks as a `GUIEnv`: a thin adapter over OSWorld's own `DesktopEnv`.

OSWorld's `desktop_env.desktop_env.DesktopEnv` (PyPI `desktop-env`, we target 1.0.2) boots a VM
(Docker provider: QEMU inside the happysixd/osworld-docker image), runs a task's set-up steps on
`reset(task_config=...)`, executes pyautogui code on `step(action, pause)` (old gym 4-tuple, reward
always 0) and scores the final state with the task's checker on `evaluate()`. This module drives
it with UI-TARS actions. Where it departs from OSWorld's runner (lib_run_single.py) and ARPO's
rollout workers:

- Only converter output reaches the VM: an `Action` goes through `to_pyautogui` (whitelisted
  pyautogui calls with literal arguments) and model text is never executed. `finished` becomes
  'DONE', `call_user` 'FAIL' (OSWorld scores an infeasible task 1 only after FAIL), `wait`
  'WAIT'. An action the converter refuses (an unknown key) is a no-op step whose info carries
  'action_error'; the VM is not touched.
- Typing without a clipboard: text pyautogui cannot type is pasted (`arpo_lib.actions`), which
  needs xclip or xsel in the VM. Before the first such paste of a VM, the VM is asked
  (`CLIPBOARD_PROBE`, through OSWorld's controller); without either, the text is typed as far as
  pyautogui can type it (the ASCII part, and the Enter of a trailing newline) and info's
  'action_error' says what was lost. (Pasting blind, the VM's `python -c` would exit 1 at the copy,
  its error sent to /dev/null: the whole text and the Enter lost, and nothing said.) The keys
  that paste depend on the focused window, asked before each paste (`FOCUS_PROBE`): ctrl+shift+v
  in a terminal, where ctrl+v is the shell's quoted-insert and the text was lost, ctrl+v elsewhere.
- Reward: 0 until the episode ends, then the task's score from `evaluate()`, also when the episode
  is truncated at `max_steps` (OSWorld and ARPO evaluate the final state whatever ended the loop).
  The screenshot keeps the VM's resolution, which must equal `screen_size` (a mismatch would
  mis-place every click, so it is refused).
- One cache directory per environment: `cache_root/<host>-<pid>-<random>`, passed as
  DesktopEnv's `cache_dir`. The original shared one, so parallel rollouts of the same task
  overwrote each other's downloaded inputs and the result files the checkers read. The directory
  is deleted on `close`; directories left by killed processes of this host are deleted by the next
  environment built there, after removing the VM container they recorded.
- Boot with retries: the DesktopEnv is built on the first `reset` (booting takes minutes) and
  kept across episodes (each reset reverts the VM). A failed boot or task set-up is retried
  `boot_retries` times with exponential back-off on a fresh DesktopEnv, then raises `EnvError`.
- Infrastructure failures are `EnvError`: if step/evaluate raises or the VM returns no screenshot
  or, on GNOME, a screen of one colour (a screensaver's blank, a display gone), or a VM whose lock
  screen is up before an action (`LOCK_PROBE`; ARPO's maintainers name VMs that locked during slow
  training steps as a cause of a failed reproduction), the DesktopEnv is closed (stopping its container), a fresh one is booted on the next reset, and
  the episode is reported as an infrastructure failure, never scored as the policy's.
- Preflight before booting (provider "docker"): the docker package, a reachable Docker engine,
  the pulled image, /dev/kvm (without KVM the VM boots too slowly to be usable: an error unless
  `allow_no_kvm`) and the VM disk image. Left alone, DesktopEnv would download the image (tens of
  GB) into ./docker_vm_data during the first reset, far past any worker timeout.
  These failures raise `OSWorldSetupError` (a ValueError) or ImportError: the environment workers
  treat both as set-up errors that stop the run instead of retrying forever.
- A separate interpreter: desktop-env pins torch 2.5.1, transformers 4.35.2, gymnasium 0.28.1 and
  numpy 1.26.4, so it lives in its own venv (scripts/setup_osworld.sh; `find_osworld_python()`).
  This module imports neither desktop_env nor torch at import time: it loads in both interpreters,
  and `desktop_env_class` swaps in `arpo_lib.envs.osworld.fake.FakeDesktopEnv` (no Docker).
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import io
import logging
import math
import os
import shutil
import socket
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from PIL import Image

from arpo_lib.actions import Action, ActionParseError, lost_without_clipboard, paste_keys_for, pastes, to_pyautogui
from arpo_lib.envs.base import EnvError, GUIEnv, Observation
from arpo_lib.envs.osworld.downloads import DownloadCache, default_download_cache
from arpo_lib.envs.osworld.machine import (  # noqa: F401 (names tests and tools use from here)
    OSWorldSetupError, workbench_cache, osworld_venv, default_vm_path, find_osworld_python,
    preflight_docker, _pid_alive, _remove_container, remove_stale_cache_dirs, DOCKER_IMAGE,
    KVM_DEVICE, SETUP_SCRIPT, VM_IMAGE_NAMES, CONTAINER_FILE,
)

log = logging.getLogger(__name__)

DESKTOP_ENV_CLASS = "desktop_env.desktop_env:DesktopEnv"
SANDBOX_PROVIDER = "sandbox"
"""provider="sandbox": OSWorld's own DesktopEnv on the workbench's desktop sandbox (no VM, no
Docker, no KVM; desktop_sandbox/osworld.py)."""
SANDBOX_DESKTOP_ENV_CLASS = "desktop_sandbox.osworld:SandboxDesktopEnv"
"""OSWorld's environment class, imported when an `OSWorldEnv` is built."""
CLIPBOARD_PROBE = "import pyperclip\nprint('clipboard:', bool(pyperclip.determine_clipboard()[0]))"
"""Run in the VM before its first paste: pyperclip's own choice of copy mechanism (xclip, xsel,
wl-copy, klipper, Qt), which is falsy when it found none. Prints `clipboard: True` or `False`
(nothing when pyperclip is missing: no clipboard either)."""
FOCUS_PROBE = ("from Xlib import X, display\nd = display.Display()\n"
               "p = d.screen().root.get_full_property(d.intern_atom('_NET_ACTIVE_WINDOW'), X.AnyPropertyType)\n"
               "w = d.create_resource_object('window', int(p.value[0])) if p is not None and len(p.value) else None\n"
               "print('focus:', '.'.join((w.get_wm_class() or ()) if w is not None and p.value[0] else ()))")
"""Run in the VM before a paste: the focused window's WM_CLASS (`instance.Class`, python-xlib,
which pyautogui needs on X11), printed as `focus: <it>` (empty when no window has the focus)."""
LOCK_PROBE = ("import os, subprocess\n"
              "env = dict(os.environ, DBUS_SESSION_BUS_ADDRESS=os.environ.get('DBUS_SESSION_BUS_ADDRESS') or "
              "'unix:path=/run/user/%d/bus' % os.getuid())\n"
              "done = subprocess.run(['gdbus', 'call', '--session', '--dest', 'org.gnome.ScreenSaver', "
              "'--object-path', '/org/gnome/ScreenSaver', '--method', 'org.gnome.ScreenSaver.GetActive'], "
              "capture_output=True, text=True, env=env, timeout=10)\n"
              "print('locked:', done.stdout.strip() == '(true,)')")
"""Run in the VM before each action: whether GNOME's lock screen is up (GNOME Shell's
org.gnome.ScreenSaver on the session bus, at the path OSWorld's task files name when the
variable is unset), printed as `locked: True` or `False` (`False` where the question cannot be
asked: a desktop without the service, no gdbus)."""
_MANAGED_KWARGS = ("provider_name", "region", "path_to_vm", "action_space", "cache_dir", "screen_size",
                   "headless", "require_a11y_tree", "os_type")
"""DesktopEnv arguments set from OSWorldEnv's own options (not allowed in `desktop_env_kwargs`)."""


SETUP_FAILURE_POLICIES = ("run", "skip", "error")
"""What an episode does when the task's set-up did not do what it asked (`on_setup_failure`)."""
DESKTOPS = ("gnome", "openbox")
"""The desktops of provider "sandbox" (desktop_sandbox/gnome.py: GNOME is OSWorld's VM's)."""


class OSWorldTaskFileError(ValueError):
    """desktop_env refuses the task file itself (a set-up step type it does not know, a parameter
    its step does not take, a step without parameters): booting again cannot help. A ValueError:
    a run stops naming the file; `sandbox_check` and the census report it and go on."""


def _task_file_refused(error: BaseException) -> str | None:
    """Why `error`, raised by DesktopEnv.reset, is the task file's fault (None: it may be the
    machine's, worth a retry). desktop_env's SetupController asserts that a step's type exists,
    calls the step with the file's parameters (a TypeError for one it does not take) and wraps
    what a step raises in an Exception."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, AssertionError) and "cannot find init function" in str(seen):
            return f"unknown set-up step type ({seen})"
        if isinstance(seen, TypeError) and "unexpected keyword argument" in str(seen):
            return f"a set-up step parameter it does not take ({seen})"
        if isinstance(seen, KeyError) and str(seen).strip("'") in ("type", "parameters"):
            return f"a set-up step without {seen}"
        seen = seen.__cause__ or seen.__context__
    return None


class OSWorldTaskSetupFailed(ValueError):
    """The task's set-up did not do what it asked and `on_setup_failure` is "error": the run stops
    (a ValueError: environment workers report it as a set-up error, `worker._is_setup_error`)."""


# --------------------------------------------------------------------------------------------
# Resolving options
# --------------------------------------------------------------------------------------------

_MOVED_MODULES = {"arpo_lib.envs.osworld_fake": "arpo_lib.envs.osworld.fake",
                  "arpo_lib.envs.osworld_tasks": "arpo_lib.envs.osworld.tasks"}
"""Module paths that configs written before the package layout name (still accepted)."""


def _import_object(spec: str, what: str) -> Any:
    """`"package.module:name"` -> the object."""
    module_name, sep, attr = spec.partition(":")
    if not (sep and module_name and attr):
        raise ValueError(f"{what} must be 'module:name', got {spec!r}")
    if module_name in _MOVED_MODULES:
        warnings.warn(f"{what}: {module_name} is now {_MOVED_MODULES[module_name]}; update the config", stacklevel=2)
        module_name = _MOVED_MODULES[module_name]
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(f"{what} {spec!r}: module {module_name!r} has no {attr!r}") from None


def _desktop_env_class(spec: str | type) -> type:
    if not isinstance(spec, str):
        return spec
    try:
        return _import_object(spec, "desktop_env_class")
    except ImportError as e:
        if spec != DESKTOP_ENV_CLASS:
            raise
        found = find_osworld_python()
        raise ImportError(
            f"Cannot import OSWorld's DesktopEnv in {sys.executable} ({e}). desktop-env 1.0.2 pins "
            f"torch 2.5.1, transformers 4.35.2, gymnasium 0.28.1 and numpy 1.26.4, so it gets its own "
            f"virtual environment: run `bash {SETUP_SCRIPT}` and run the environment workers with "
            f"that interpreter ({found or osworld_venv() / 'bin' / 'python'}). To try the pipeline "
            f"without Docker: desktop_env_class='arpo_lib.envs.osworld.fake:FakeDesktopEnv', "
            f"provider='fake'.") from e


def _load_task(task: str | Mapping[str, Any],
               task_loader: Callable[[str], Mapping[str, Any]] | str | None) -> dict[str, Any]:
    """The task config: `task` itself if a mapping, else `task_loader(task)` (default: the fetched
    task data, arpo_lib.envs.osworld.tasks.load_task, plus the task's domain). Checked for the
    fields OSWorld reads."""
    if isinstance(task, Mapping):
        config = task
    elif task_loader is None:
        from arpo_lib.envs.osworld.tasks import load_task, task_domain

        config = {"domain": task_domain(task), **load_task(task)}  # the JSON files have no domain
    else:
        if isinstance(task_loader, str):
            task_loader = _import_object(task_loader, "task_loader")
        config = task_loader(task)
    missing = [k for k in ("id", "instruction", "evaluator") if k not in config]
    if missing:
        raise ValueError(f"OSWorld task config {config.get('id', task)!r} lacks {', '.join(missing)}")
    if not isinstance(config["evaluator"], Mapping) or "func" not in config["evaluator"]:
        raise ValueError(f"OSWorld task {config['id']!r}: evaluator must be a dict with 'func'")
    if not isinstance(task, Mapping) and config["id"] != task:
        raise ValueError(f"the task loader returned task {config['id']!r} for {task!r}")
    return copy.deepcopy(dict(config))


# --------------------------------------------------------------------------------------------
# The environment
# --------------------------------------------------------------------------------------------

class OSWorldEnv(GUIEnv):
    """One OSWorld task in one VM (a `DesktopEnv`), speaking UI-TARS actions.

    `reset`/`step` return `Observation(screenshot=the VM screen (screen_size, RGB), instruction)`.
    Info: 'task_id', 'domain' (None if the task config has none), 'accessibility_tree' (with
    `require_a11y_tree`); after a step also 'code' (what the VM executed: pyautogui code,
    'WAIT'/'DONE'/'FAIL', or None for a refused action), 'action_error', 'desktop_info'
    (DesktopEnv's info dict) and, once the episode ends, 'score'.
    """

    def __init__(
        self,
        task: str | Mapping[str, Any],
        *,
        provider: str = "docker",
        screen_size: tuple[int, int] | list[int] = (1920, 1080),
        max_steps: int = 15,
        path_to_vm: str | None = None,
        region: str | None = None,
        os_type: str = "Ubuntu",
        headless: bool = True,
        require_a11y_tree: bool = False,
        cache_root: str | os.PathLike | None = None,
        pause_s: float = 0.5,
        pause_vm: bool = True,
        download_cache: str | os.PathLike | None = "auto",
        boot_retries: int = 3,
        backoff_s: float = 10.0,
        allow_no_kvm: bool = False,
        desktop_env_class: str | type = DESKTOP_ENV_CLASS,
        desktop_env_kwargs: Mapping[str, Any] | None = None,
        task_loader: Callable[[str], Mapping[str, Any]] | str | None = None,
        desktop: str = "gnome",
        on_setup_failure: str = "run",
        network: str = "none",
        sudo: str = "user",
        prestart: bool = False,
    ) -> None:
        """Load the task, import the DesktopEnv class and check the machine; the VM boots on the
        first `reset`.

        task: an OSWorld task id (its config comes from `task_loader(task)`, a function or a
            "module:function" path; default arpo_lib.envs.osworld.tasks.load_task) or the task
            config itself.
        provider, path_to_vm, region, os_type, headless, require_a11y_tree: DesktopEnv's options
            (provider_name=provider). With provider "docker", path_to_vm defaults to
            `default_vm_path(os_type)`. Provider "sandbox": no VM; OSWorld's DesktopEnv runs on
            the workbench's desktop sandbox (desktop_sandbox/osworld.py; sandbox options such
            as limits go in desktop_env_kwargs={"sandbox_options": {...}}).
        screen_size: the VM screen (width, height); screenshots must have this size.
        max_steps: actions per episode before `truncated`.
        cache_root: parent of this environment's own cache dir (default
            ~/.cache/arpo-workbench/osworld-cache).
        pause_s: seconds DesktopEnv waits after an action before its screenshot (`pause`): 0.5 in
            ARPO's training (the default), 1 in the OSWorld fork's UI-TARS evaluation.
        pause_vm: where the DesktopEnv has `pause()`/`unpause()` (the ARPO authors' fork: the
            Docker container is paused), keep the VM paused while the model thinks, as ARPO does,
            so the guest's clock and screensaver do not run between actions.
        download_cache: a directory shared by every environment of the machine holding the files
            task set-ups download (`auto`: ~/.cache/arpo-workbench/osworld-downloads; None: off);
            see `arpo_lib.envs.osworld.downloads`.
        boot_retries, backoff_s: a failed boot is retried this many times, after backoff_s,
            2*backoff_s, 4*backoff_s... seconds.
        allow_no_kvm: boot without /dev/kvm (a warning instead of an error).
        desktop_env_class: the class, or its "module:Class" path (the fake for dry runs).
        desktop_env_kwargs: further DesktopEnv arguments (snapshot_name, client_password,
            enable_proxy, require_terminal).
        desktop: provider "sandbox" only: "gnome" (OSWorld's VM's desktop: GNOME Shell with
            Ubuntu's look, Ctrl+Alt+T for a terminal) or "openbox" (cheaper, no launcher).
        on_setup_failure: when the task's set-up did not do what it asked (a command failed, a
            window to activate was not there, a launched program died, a download was not written;
            provider "sandbox", which observes each step): "run" the episode anyway, "skip" it (the
            reset's info says `setup_skipped`; the rollout engine records it as `setup_failed`,
            counted, never trained on) or "error" (the run stops, naming the task and the step).
            Either way the reset's info lists them in `setup_failures`.
        network: provider "sandbox" only: "none" (the default: the sandbox's own loopback) or
            "user" (a user-mode network like the VM's: outside addresses, never the host's
            loopback, its addresses, link-local or metadata ones; desktop_sandbox/usernet.py).
        sudo: provider "sandbox" only: "user" (the default: sudo asks for the VM's password and gives
            no privilege) or "root" (sudo gives root inside the sandbox, as on the VM, over a writable
            layer of the system directories that the next reset after its use throws away: the
            install and system-configuration tasks; needs root on the host;
            desktop_sandbox/superuser.py).
        prestart: provider "sandbox" only: keep a second sandbox made ready while an episode runs,
            so that a reset hands over a fresh desktop instead of resetting the one just used (the
            desktop's part of a reset drops to the hand-over; costs a second idle desktop's memory:
            desktop_sandbox/osworld.py SandboxProvider). `reset`'s info has `reset_timings`.
        """
        size = tuple(screen_size)
        if len(size) != 2 or not all(isinstance(v, int) and v > 0 for v in size):
            raise ValueError(f"screen_size must be two positive ints (width, height), got {screen_size!r}")
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if pause_s < 0 or backoff_s < 0:
            raise ValueError(f"pause_s and backoff_s must be >= 0, got {pause_s}, {backoff_s}")
        if boot_retries < 0:
            raise ValueError(f"boot_retries must be >= 0, got {boot_retries}")
        if on_setup_failure not in SETUP_FAILURE_POLICIES:
            raise ValueError(f"on_setup_failure must be one of {SETUP_FAILURE_POLICIES}, got {on_setup_failure!r}")
        if desktop not in DESKTOPS:
            raise ValueError(f"desktop must be one of {DESKTOPS}, got {desktop!r}")
        if network not in ("none", "user"):
            raise ValueError(f"network must be 'none' or 'user', got {network!r}")
        if network != "none" and provider != SANDBOX_PROVIDER:
            raise ValueError("network='user' gives the sandbox a network: it needs provider='sandbox' (a VM has its own)")
        if sudo not in ("user", "root"):
            raise ValueError(f"sudo must be 'user' or 'root', got {sudo!r}")
        if prestart and provider != SANDBOX_PROVIDER:
            raise ValueError("prestart keeps a second sandbox ready: it needs provider='sandbox'")
        if sudo != "user" and provider != SANDBOX_PROVIDER:
            raise ValueError("sudo='root' gives root inside the sandbox: it needs provider='sandbox' (a VM's sudo is real)")
        if desktop != "gnome" and provider != SANDBOX_PROVIDER:
            raise ValueError(f"desktop={desktop!r} chooses the sandbox's desktop: it needs provider='sandbox'")
        self.lock_check = provider != SANDBOX_PROVIDER
        """Ask a VM before each action whether its screen is locked (LOCK_PROBE). The sandbox has no
        lock screen (no org.gnome.ScreenSaver: GNOME Shell offers it only with GDM), so it is not asked."""
        self.blank_is_failure = desktop == "gnome"
        """GNOME (the VM's desktop) always draws its top bar: a screen of one colour is a blanked,
        locked or lost display. openbox's bare desktop is black until a window opens."""
        clash = set(desktop_env_kwargs or ()) & set(_MANAGED_KWARGS)
        if clash:
            raise ValueError(f"desktop_env_kwargs may not set {sorted(clash)}: use OSWorldEnv's own options")

        self.task_config = _load_task(task, task_loader)
        self.task_id: str = self.task_config["id"]
        self.domain: str | None = self.task_config.get("domain")
        self.instruction: str = self.task_config["instruction"]
        self.name = f"osworld/{self.task_id}"
        self.screen_size: tuple[int, int] = size  # type: ignore[assignment]
        self.max_steps = max_steps
        self.pause_s = float(pause_s)
        self.pause_vm = bool(pause_vm)
        self.downloads = None if download_cache is None else DownloadCache(
            default_download_cache() if download_cache == "auto" else Path(download_cache))
        self.boot_retries = boot_retries
        self.backoff_s = float(backoff_s)
        self.require_a11y_tree = require_a11y_tree
        self.on_setup_failure = on_setup_failure
        desktop_env_kwargs = dict(desktop_env_kwargs or {})

        if provider == SANDBOX_PROVIDER:  # OSWorld's DesktopEnv on the desktop sandbox (no VM)
            if desktop_env_class == DESKTOP_ENV_CLASS:
                desktop_env_class = SANDBOX_DESKTOP_ENV_CLASS
            path_to_vm = path_to_vm or "desktop-sandbox"
            self.pause_vm = False  # nothing to pause: see desktop_sandbox/osworld.py
            desktop_env_kwargs["sandbox_options"] = {"window_manager": desktop, "network": network, "sudo": sudo,
                                                     "prestart": bool(prestart),
                                                     **(desktop_env_kwargs.get("sandbox_options") or {})}
        self._desktop_env_cls = _desktop_env_class(desktop_env_class)
        if provider == "docker":
            path_to_vm = preflight_docker(path_to_vm, os_type, allow_no_kvm)
        root = Path(cache_root) if cache_root is not None else workbench_cache() / "osworld-cache"
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_cache_dirs(root)
        self.cache_dir = Path(tempfile.mkdtemp(prefix=f"{socket.gethostname()}-{os.getpid()}-", dir=root))
        """This environment's own DesktopEnv cache_dir (deleted on close)."""
        self._desktop_kwargs: dict[str, Any] = {
            "provider_name": provider, "region": region, "path_to_vm": path_to_vm,
            "action_space": "pyautogui", "cache_dir": str(self.cache_dir), "screen_size": size,
            "headless": headless, "require_a11y_tree": require_a11y_tree, "os_type": os_type,
            **(desktop_env_kwargs or {}),
        }
        self._desktop: Any = None
        self._paused = False
        self._closed = False
        self._episode_over = True  # until reset
        self._steps = 0
        self._screen: Image.Image | None = None
        self._clipboard: bool | None = None
        """Whether this DesktopEnv's VM has a clipboard tool (None: not asked yet)."""

    # ---- GUIEnv --------------------------------------------------------------------------

    def reset(self, seed: int | None = None) -> tuple[Observation, dict[str, Any]]:
        """Boot the VM if needed and set the task up (retrying); EnvError if it never comes up."""
        self._check_open()
        self._episode_over = True
        self._screen, obs = self._boot(seed)
        self._steps = 0
        info = self._info(obs)
        failures = list(getattr(self._desktop, "setup_failures", None) or [])
        info["setup_failures"] = failures
        if timings := getattr(self._desktop, "reset_timings", None):  # the sandbox's: its desktop part and set-up
            info["reset_timings"] = dict(timings)
        if failures:
            log.warning("%s: the set-up did not do what it asked: %s", self.name, "; ".join(failures)[:1000])
            if self.on_setup_failure == "error":
                raise OSWorldTaskSetupFailed(f"{self.name}: the task's set-up failed (env.on_setup_failure=error): "
                                             + "; ".join(failures)[:2000])
            if self.on_setup_failure == "skip":
                info["setup_skipped"] = True
                return Observation(self._screen, self.instruction, 0), info  # the episode stays over
        self._episode_over = False
        with self._vm_call("pause"):
            self._set_paused(True)  # the model thinks about the first screen now
        return Observation(self._screen, self.instruction, 0), info

    def _step(self, action: Action) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        """Execute one UI-TARS action (points in screen pixels); the score comes when it ends."""
        try:
            code: str | None = to_pyautogui(action, self.screen_size)
            error = None
        except ActionParseError as e:
            code, error = None, str(e)
        obs: Any = None
        desktop_info: dict[str, Any] = {}
        terminated = False
        if code is not None:
            with self._vm_call(f"step ({action.kind})"):
                self._set_paused(False)
                if self.lock_check and self._screen_locked():
                    raise EnvError(f"{self.name}: the screen is locked (GNOME's lock screen came up between actions): "
                                   "not a screen the agent should act on, so not its failure")
                lost = lost_without_clipboard(action)
                if lost is not None and not self._has_clipboard():
                    code = to_pyautogui(action, self.screen_size, clipboard=False)
                    error = (f"no clipboard tool in the VM (pyperclip finds neither xclip nor xsel): typed what "
                             f"pyautogui can type, lost {lost[:200]!r}")
                elif pastes(action):
                    code = to_pyautogui(action, self.screen_size, paste_keys=paste_keys_for(self._focused_class()))
                obs, _, done, desktop_info = self._desktop.step(code, pause=self.pause_s)
                self._screen = self._screenshot(obs)
            terminated = bool(done) or code in ("DONE", "FAIL")
        truncated = not terminated and self._steps >= self.max_steps
        desktop_info = dict(desktop_info or {})
        if desktop_info.get("crashed"):  # the sandbox's report: the task's application died of a crash
            self._episode_over = True
            raise EnvError(f"{self.name}: a program the episode needs crashed: {'; '.join(desktop_info['crashed'])[:500]}")
        # The sandbox provider refuses code outside the action space (info["action_error"]).
        error = "; ".join(e for e in (error, desktop_info.get("action_error")) if e) or None
        info = {**self._info(obs), "code": code, "action_error": error, "desktop_info": desktop_info}
        reward = 0.0
        if terminated or truncated:
            self._episode_over = True
            with self._vm_call("evaluate"):
                self._set_paused(False)
            reward = info["score"] = self._evaluate(info)
        else:
            with self._vm_call("pause"):
                self._set_paused(True)  # the model thinks now
        return Observation(self._screen, self.instruction, self._steps), reward, terminated, truncated, info

    def close(self) -> None:
        """Stop the VM (its container) and delete this environment's cache dir. Safe twice."""
        self._discard_desktop()
        if not self._closed:
            self._closed = True
            if not (self.cache_dir / CONTAINER_FILE).exists():  # else a VM may live: keep the record
                shutil.rmtree(self.cache_dir, ignore_errors=True)

    # ---- helpers --------------------------------------------------------------------------

    @property
    def desktop_env(self) -> Any:
        """The running DesktopEnv, or None before the first reset and after a failure."""
        return self._desktop

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")

    def _boot(self, seed: int | None) -> tuple[Image.Image, Any]:
        """(screenshot, observation dict) after `reset(task_config)`, building the DesktopEnv if
        needed; each failure discards the DesktopEnv and retries after a back-off."""
        failures: list[str] = []
        for attempt in range(self.boot_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                if self._desktop is None:
                    self._desktop = self._new_desktop_env()
                self._set_paused(False)
                task_cache = self.cache_dir / str(self.task_config["id"])
                if self.downloads is not None:
                    self.downloads.prefill(self.task_config, task_cache)
                obs = self._desktop.reset(task_config=copy.deepcopy(self.task_config), seed=seed)
                screen = self._screenshot(obs)
                if self.downloads is not None:
                    self.downloads.harvest(self.task_config, task_cache)
            except OSWorldSetupError:
                self._discard_desktop()
                raise
            except Exception as e:
                refused = _task_file_refused(e)
                if refused is not None:  # a retry cannot fix the task file: no boot loop
                    raise OSWorldTaskFileError(f"{self.name}: desktop_env refuses the task file: {refused}") from e
                failures.append(f"{type(e).__name__}: {e}")
                self._discard_desktop()
                continue
            self._note_container()
            return screen, obs
        raise EnvError(f"{self.name}: the VM did not come up in {len(failures)} attempts; "
                       f"last error: {failures[-1]}")

    def _new_desktop_env(self) -> Any:
        try:
            return self._desktop_env_cls(**self._desktop_kwargs)
        except (TypeError, ValueError, NotImplementedError, ImportError) as e:
            # Options it refuses or a dependency it lacks: booting again would fail the same way.
            raise OSWorldSetupError(
                f"{getattr(self._desktop_env_cls, '__name__', self._desktop_env_cls)} could not be created "
                f"({type(e).__name__}: {e}); check provider and desktop_env_kwargs, and that desktop-env "
                f"1.0.2 is installed (`bash {SETUP_SCRIPT}`).") from e

    @contextlib.contextmanager
    def _vm_call(self, what: str) -> Iterator[None]:
        """Any failure inside is the VM's: drop the DesktopEnv (the next reset boots a fresh one),
        end the episode, raise EnvError."""
        try:
            yield
        except OSWorldSetupError:
            raise
        except Exception as e:
            self._discard_desktop()
            self._episode_over = True
            if isinstance(e, EnvError):
                raise
            raise EnvError(f"{self.name}: the VM failed during {what}: {type(e).__name__}: {e}") from e

    def _screenshot(self, obs: Any) -> Image.Image:
        png = obs.get("screenshot") if isinstance(obs, Mapping) else None
        if not png:
            raise EnvError(f"{self.name}: the VM returned no screenshot (its server stopped answering)")
        try:
            image = Image.open(io.BytesIO(png))
            image.load()
        except Exception as e:
            raise EnvError(f"{self.name}: the VM returned an unreadable screenshot ({e})") from e
        if image.size != self.screen_size:
            raise OSWorldSetupError(
                f"{self.name}: the VM screen is {image.size[0]}x{image.size[1]} but screen_size is "
                f"{self.screen_size[0]}x{self.screen_size[1]}: every click would land in the wrong place. "
                f"Set screen_size to the VM's resolution.")
        image = image.convert("RGB")
        extrema = image.getextrema()
        if self.blank_is_failure and all(low == high for low, high in extrema):
            raise EnvError(f"{self.name}: the screen is one colour, rgb{tuple(low for low, _ in extrema)} (blanked, "
                           f"locked or its display gone): not a screen the agent should act on, so not its failure")
        return image

    def _evaluate(self, info: dict[str, Any]) -> float:
        """The checker's score of the final state. A checker that raises (or returns no finite
        number) scores 0, as in ARPO, and is reported as `checker_error` in `info`: excluding such
        episodes would bias success upward."""
        try:
            score = float(self._desktop.evaluate())
            if not math.isfinite(score):
                raise ValueError(f"the checker returned {score}")
        except Exception as e:  # noqa: BLE001 - any checker failure scores 0
            info["checker_error"] = f"{type(e).__name__}: {e}"[:500]
            log.warning("%s: the checker failed (%s): scored 0", self.name, info["checker_error"])
            return 0.0
        return score

    def _has_clipboard(self) -> bool:
        """Whether the VM has a clipboard tool, asked once per DesktopEnv (CLIPBOARD_PROBE). A
        DesktopEnv without OSWorld's controller, or a probe without an answer, counts as having one
        (the paste is tried; the question is asked again next time)."""
        if self._clipboard is None:
            run = getattr(getattr(self._desktop, "controller", None), "execute_python_command", None)
            answer = run(CLIPBOARD_PROBE) if callable(run) else None
            if not isinstance(answer, Mapping) or "status" not in answer:
                return True
            self._clipboard = "clipboard: True" in str(answer.get("output") or "")
            if not self._clipboard:
                log.warning("%s: the VM has no clipboard tool (xclip or xsel): text outside ASCII is typed as far "
                            "as pyautogui can type it", self.name)
        return self._clipboard

    def _screen_locked(self) -> bool:
        """Whether GNOME's lock screen is up in the VM (LOCK_PROBE through OSWorld's controller;
        False when it cannot be asked)."""
        run = getattr(getattr(self._desktop, "controller", None), "execute_python_command", None)
        answer = run(LOCK_PROBE) if callable(run) else None
        return isinstance(answer, Mapping) and "locked: True" in str(answer.get("output") or "")

    def _focused_class(self) -> str | None:
        """The WM_CLASS of the VM's focused window (FOCUS_PROBE through OSWorld's controller), None
        when it cannot be asked or no window has the focus."""
        run = getattr(getattr(self._desktop, "controller", None), "execute_python_command", None)
        answer = run(FOCUS_PROBE) if callable(run) else None
        output = str(answer.get("output") or "") if isinstance(answer, Mapping) else ""
        found = [line[len("focus:"):].strip() for line in output.splitlines() if line.startswith("focus:")]
        return found[0] if found and found[0] else None

    def _set_paused(self, paused: bool) -> None:
        """Pause or resume the VM where the DesktopEnv can (the fork's pause()/unpause())."""
        if not self.pause_vm or self._desktop is None or self._paused == paused:
            return
        method = getattr(self._desktop, "pause" if paused else "unpause", None)
        if method is None:
            self.pause_vm = False  # desktop-env without the fork's methods: nothing to do
            return
        method()
        self._paused = paused

    def _info(self, obs: Any) -> dict[str, Any]:
        info: dict[str, Any] = {"task_id": self.task_id, "domain": self.domain}
        if self.require_a11y_tree:
            info["accessibility_tree"] = obs.get("accessibility_tree") if isinstance(obs, Mapping) else None
        return info

    def _note_container(self) -> None:
        """Record the VM's container id (Docker provider), so that a process that dies without
        `close` does not leak it: `remove_stale_cache_dirs` removes it later."""
        container = getattr(getattr(self._desktop, "provider", None), "container", None)
        container_id = getattr(container, "id", None)
        record = self.cache_dir / CONTAINER_FILE
        if isinstance(container_id, str) and container_id:
            record.write_text(container_id)
        else:
            record.unlink(missing_ok=True)

    def _discard_desktop(self) -> None:
        """Close the DesktopEnv (stops its VM); forget the container record if that worked."""
        desktop, self._desktop = self._desktop, None
        self._paused = False
        self._clipboard = None
        if desktop is None:
            return
        try:
            desktop.close()
        except Exception:
            return  # the container may still run: keep its record for remove_stale_cache_dirs
        (self.cache_dir / CONTAINER_FILE).unlink(missing_ok=True)
