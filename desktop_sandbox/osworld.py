"""OSWorld's own `DesktopEnv` on the workbench's desktop sandbox: no VM, no Docker, no KVM.

`SandboxDesktopEnv` is OSWorld's `desktop_env.desktop_env.DesktopEnv` (whichever build is
installed: the ARPO fork's or PyPI desktop-env 1.0.2) with one thing changed, the provider: where
OSWorld's Docker provider boots a VM and publishes its ports, `SandboxProvider` starts a desktop
sandbox (desktop_sandbox/sandbox.py) and a loopback bridge (bridge.py) and answers
"127.0.0.1:server:chromium:vnc:vlc". Everything else is OSWorld's code, unchanged:
`SetupController` runs the task's set-up steps against the sandbox's action server,
`PythonController` takes the screenshots, the getters and metrics score the final state.

One more difference, on purpose: the agent's actions. OSWorld sends every action as a Python
command to the server's `/execute`, which runs any code; a model's output would run unchecked.
Here `step` sends the action to `/run_action` instead, where only the pyautogui calls the
workbench's action space generates are accepted (desktop_sandbox.action_code.check_action_code); set-up
steps and getters keep using `/execute` (they are the task's, not the agent's).

The accessibility tree (`/accessibility`, OSWorld's `{"AT": xml}`; `require_a11y_tree=True` puts
it in every observation, and the chrome getters find the address bar in it) is served where the
machine has what it takes (desktop_sandbox/a11y.py: Debian's python3-pyatspi, at-spi2-core,
dbus-daemon); elsewhere `require_a11y_tree=True` is refused, naming the missing package.

What OSWorld's VM has that this does not (yet): VNC
(port 0), pausing (pause/unpause do nothing: the sandbox's applications keep running between
actions), and Ubuntu's applications (the sandbox runs this machine's Debian ones; which exist
decides which tasks can run; LibreOffice is in the tree only with its GTK 3 front end).

    from desktop_sandbox.osworld import SandboxDesktopEnv
    env = SandboxDesktopEnv(action_space="pyautogui", screen_size=(1920, 1080))
    obs = env.reset(task_config=task)          # OSWorld's set-up steps, in the sandbox
    env.step("pyautogui.click(100, 200)")      # checked, then run
    score = env.evaluate()                     # OSWorld's getters and metric
"""
from __future__ import annotations

import concurrent.futures
import importlib
import json
import logging
import shlex
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from desktop_sandbox import a11y
from desktop_sandbox.bridge import LoopbackBridge
from desktop_sandbox.sandbox import Sandbox

log = logging.getLogger(__name__)

PROVIDER_NAME = "sandbox"
PATH_TO_VM = "desktop-sandbox"
"""What DesktopEnv is given as path_to_vm: anything non-empty keeps its VM manager from looking
for (or downloading) a disk image."""

def _xcu_item(path: str, name: str, value: str) -> str:
    return shlex.quote(f'<item oor:path="{path}"><prop oor:name="{name}" oor:op="fuse"><value>{value}</value></prop>'
                       "</item>")


def _factory(document_service: str) -> str:
    return f"/org.openoffice.Setup/Office/Factories/org.openoffice.Setup:Factory['{document_service}']"


_LIBREOFFICE_ITEMS = " ".join([
    _xcu_item("/org.openoffice.Office.Common/Misc", "ShowTipOfTheDay", "false"),
    _xcu_item("/org.openoffice.Setup/Office", "FirstStartWizardCompleted", "true"),
    _xcu_item("/org.openoffice.Office.Impress/Misc/NewDoc", "AutoPilot", "false"),  # its template chooser (7.x)
    # Tools > Options > Load/Save > General, "Always save as" (OSWorld's server README sets these on the VM)
    _xcu_item(_factory("com.sun.star.text.TextDocument"), "ooSetupFactoryDefaultFilter", "MS Word 2007 XML"),
    _xcu_item(_factory("com.sun.star.sheet.SpreadsheetDocument"), "ooSetupFactoryDefaultFilter",
              "Calc MS Excel 2007 XML"),
    _xcu_item(_factory("com.sun.star.presentation.PresentationDocument"), "ooSetupFactoryDefaultFilter",
              "Impress MS PowerPoint 2007 XML"),
])
"""A used profile's settings, as OSWorld's VM image has them: no Tip of the Day (it took the
first typed text), no first-start wizard, Impress without its template chooser; with
ooSetupLastVersion the installed version, so no "running for the first time" infobar. Word,
Excel and PowerPoint as the formats documents are saved in: Save As starts on them, and saving
in them asks nothing (LibreOffice's "Keep current format?" question is for formats other than
ODF and the default; OSWorld's checkers save Calc files with Ctrl+S and no answer). Documents
open maximised without a setting: LibreOffice's own default window state (`;4;`) is that."""

HOME_PROFILES = [
    ("vlc", "timeout 30 vlc -I dummy --reset-config vlc://quit >/dev/null 2>&1; "
            "sed -i -e 's/^#qt-privacy-ask=.*/qt-privacy-ask=0/' -e 's/^#extraintf=.*/extraintf=http/' "
            "-e 's/^#http-password=.*/http-password=password/' ~/.config/vlc/vlcrc"),
    ("soffice", "d=~/.config/libreoffice/4/user && mkdir -p $d && "
                "v=$(dpkg-query -W -f='${Version}' libreoffice-core 2>/dev/null | sed -E 's/^[0-9]+://; s/^([0-9]+[.][0-9]+).*/\\1/') && "
                "printf '%s\\n' '<?xml version=\"1.0\" encoding=\"UTF-8\"?>' "
                "'<oor:items xmlns:oor=\"http://openoffice.org/2001/registry\" xmlns:xs=\"http://www.w3.org/2001/XMLSchema\">' "
                f"{_LIBREOFFICE_ITEMS} "
                "\"<item oor:path=\\\"/org.openoffice.Setup/Product\\\"><prop oor:name=\\\"ooSetupLastVersion\\\" oor:op=\\\"fuse\\\"><value>${v:-7.4}</value></prop></item>\" "
                "'</oor:items>' > $d/registrymodifications.xcu"),
    ("code", "mkdir -p ~/.config/Code/User"),
    ("google-chrome", "mkdir -p ~/.config/google-chrome/Default && "
                      "[ -e ~/.config/google-chrome/Default/Preferences ] || echo '{}' > ~/.config/google-chrome/Default/Preferences"),
]
"""(program, shell script) run in the fresh home at every reset where the program is installed.
VLC: its default vlcrc (VLC writes it), as on OSWorld's VM: no first-run privacy dialog, the web
interface on (password "password", what OSWorld's vlc_playing_info getter sends). VLC's
configuration tasks read this file; without it their getter finds nothing. Chrome: a profile
(the VM image's Chrome has been run: task set-ups edit `Default/Preferences` before starting it,
with jq); an empty one here, which Chrome fills with its defaults at its first start. VS Code:
its user settings directory (the VM's VS Code has been run: task set-ups write
~/.config/Code/User/settings.json before starting it)."""

SETTLE_TIMEOUT_S = 20.0
"""After a set-up that started something, reset waits at most this long for the desktop to be still."""
SETTLE_QUIET_S = 1.0
"""... still meaning: windows unchanged and the programs nearly idle for this long (Sandbox.settle)."""

_PENDING = threading.local()
"""The provider options of the SandboxDesktopEnv being constructed on this thread (see
_sandbox_aware_factory)."""


class _Desktop:
    """One sandbox and the loopback bridge OSWorld's controllers reach it through."""

    def __init__(self, screen_size: tuple[int, int], options: dict[str, Any]) -> None:
        self.box = Sandbox(screen_size, **options)
        try:
            self.bridge = LoopbackBridge(self.box.socket_path)
        except BaseException:
            self.box.close()
            raise

    def fresh(self, reset: bool) -> "_Desktop":
        """A fresh episode's desktop: (after `reset_session` when `reset`: every application
        ended, the home emptied, the desktop's session started anew) the home seeded with
        HOME_PROFILES, the set-up report begun. `timings` says what each part took."""
        started = time.monotonic()
        if reset:
            self.box.reset_session()
        session = time.monotonic()
        for program, script in HOME_PROFILES:
            if self.box.execute(["sh", "-c", f"command -v {program}"], timeout=30)["returncode"] == 0:
                done = self.box.execute(script, shell=True, timeout=60)
                if done["returncode"] != 0:
                    log.warning("could not write %s's profile: %s", program, done["error"][-300:])
        self.box.post_json("/setup/begin", {})  # what follows is the task's set-up (setup_report)
        self.timings = {"session_s": round(session - started, 4), "profiles_s": round(time.monotonic() - session, 4)}
        return self

    def close(self) -> None:
        self.bridge.close()
        self.box.close()


class SandboxProvider:
    """OSWorld's provider interface (desktop_env/providers/base.py: start_emulator,
    get_ip_address, save_state, revert_to_snapshot, stop_emulator; pause_emulator and
    unpause_emulator, which the ARPO fork's DesktopEnv calls) over a desktop sandbox.

    `prestart` (a sandbox option): a second sandbox is made ready while an episode runs, so
    that OSWorld's revert hands over a desktop that is already fresh (every application of its
    last episode ended, its home emptied and seeded) instead of resetting the one just used; the
    one just used is reset in the background and becomes the next. Each episode still gets a
    desktop that no earlier episode's programs outlive; the cost is a second idle desktop's memory
    and its reset's CPU during the episode. `last_revert` says what the last revert took."""

    def __init__(self, region: str | None = None, *, screen_size: tuple[int, int] = (1920, 1080),
                 sandbox_options: dict[str, Any] | None = None) -> None:
        self.region = region
        self.screen_size = tuple(screen_size)
        options = {"window_manager": "gnome", **(sandbox_options or {})}  # OSWorld's VM's desktop
        self.prestart = bool(options.pop("prestart", False))
        self.sandbox_options = options
        self.current: _Desktop | None = None
        self._next: concurrent.futures.Future | None = None
        """The desktop being made ready for the next episode (prestart)."""
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sandbox-prestart") \
            if self.prestart else None
        self.last_revert: dict[str, Any] = {}
        """{"desktop_s": seconds the revert took, "handed_over": a prestarted desktop was used,
        "waited_s": of those, waiting for it to be ready}"""

    @property
    def box(self) -> Sandbox | None:
        """The running sandbox (None before the first start and after close)."""
        return self.current.box if self.current is not None else None

    @property
    def bridge(self) -> LoopbackBridge | None:
        return self.current.bridge if self.current is not None else None

    def start_emulator(self, path_to_vm: str, headless: bool, os_type: str = "Ubuntu", *args: Any,
                       **kwargs: Any) -> None:
        if self.box is not None and self.box.alive():
            return
        self._close_current()
        self.current = _Desktop(self.screen_size, self.sandbox_options).fresh(reset=False)
        if self.prestart and self._next is None:
            self._next = self._pool.submit(lambda: _Desktop(self.screen_size, self.sandbox_options).fresh(reset=False))
        log.info("OSWorld on the desktop sandbox: %s (%s)", self.bridge.address(), self.box.describe())

    def get_ip_address(self, path_to_vm: str) -> str:
        if self.bridge is None:
            raise RuntimeError("the sandbox is not started")
        return self.bridge.address()

    def save_state(self, path_to_vm: str, snapshot_name: str) -> None:
        raise NotImplementedError("the desktop sandbox has no snapshots: every reset starts from an empty home")

    def revert_to_snapshot(self, path_to_vm: str, snapshot_name: str) -> None:
        """OSWorld reverts the VM to its snapshot; the sandbox ends every application of the
        episode and empties the home (or, with `prestart`, hands over the desktop made ready
        meanwhile). None: the path does not change."""
        started = time.monotonic()
        self.last_revert = {"handed_over": False}
        if self.prestart and self._next is not None:
            ready, self._next = self._next, None
            try:
                spare = ready.result()
            except Exception as e:  # noqa: BLE001 - the episode goes on with the desktop it has, reset
                log.warning("the prestarted desktop could not be made ready (%s): resetting this one", e)
            else:
                self.last_revert.update(handed_over=True, waited_s=round(time.monotonic() - started, 4))
                used, self.current = self.current, spare
                if used is not None:
                    self._next = self._pool.submit(self._refresh_or_replace, used)
        if not self.last_revert["handed_over"] and self.box is not None and self.box.alive():
            self.last_revert.update(self.current.fresh(reset=True).timings)
        self.last_revert["desktop_s"] = round(time.monotonic() - started, 4)
        return None

    def _refresh_or_replace(self, used: _Desktop) -> _Desktop:
        """The desktop just used, reset for a later episode (a new one if it died meanwhile)."""
        if used.box.alive():
            return used.fresh(reset=True)
        used.close()
        return _Desktop(self.screen_size, self.sandbox_options).fresh(reset=False)

    def _close_current(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None

    def stop_emulator(self, path_to_vm: str, *args: Any, **kwargs: Any) -> None:
        self._close_current()
        if self._next is not None:
            pending, self._next = self._next, None
            try:
                pending.result().close()
            except Exception:  # noqa: BLE001 - it never came up: nothing to close
                pass

    def pause_emulator(self) -> None:
        """Nothing: the sandbox is not paused between actions (its applications keep running)."""

    def unpause_emulator(self) -> None:
        pass


class SandboxVMManager:
    """OSWorld's VM manager interface; the sandbox has no images to register or download."""

    def initialize_registry(self, *args: Any, **kwargs: Any) -> None:
        pass

    def add_vm(self, *args: Any, **kwargs: Any) -> None:
        pass

    def delete_vm(self, *args: Any, **kwargs: Any) -> None:
        pass

    def occupy_vm(self, *args: Any, **kwargs: Any) -> None:
        pass

    def list_free_vms(self, *args: Any, **kwargs: Any) -> list[str]:
        return [PATH_TO_VM]

    def check_and_clean(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_vm_path(self, *args: Any, **kwargs: Any) -> str:
        return PATH_TO_VM


def _desktop_env_module() -> Any:
    try:
        return importlib.import_module("desktop_env.desktop_env")
    except ImportError as e:
        raise ImportError(
            f"OSWorld's desktop_env is not importable here ({e}): the sandbox provider runs OSWorld's own "
            "DesktopEnv (its set-up, getters and metrics). Install it with `./workbench setup-osworld` and run "
            "in that environment.") from e


def install() -> None:
    """Make DesktopEnv's provider factory give a SandboxDesktopEnv under construction the sandbox
    provider (every other DesktopEnv gets OSWorld's own, unchanged). Idempotent."""
    module = _desktop_env_module()
    factory = module.create_vm_manager_and_provider
    if getattr(factory, "_arpo_sandbox_aware", False):
        return

    def _sandbox_aware_factory(provider_name: str, region: str | None, *args: Any, **kwargs: Any) -> Any:
        pending = getattr(_PENDING, "options", None)
        if pending is None:
            return factory(provider_name, region, *args, **kwargs)
        return SandboxVMManager(), SandboxProvider(region, **pending)

    _sandbox_aware_factory._arpo_sandbox_aware = True  # type: ignore[attr-defined]
    module.create_vm_manager_and_provider = _sandbox_aware_factory


def _make_class() -> type:
    install()
    base = _desktop_env_module().DesktopEnv

    class SandboxDesktopEnv(base):  # type: ignore[misc, valid-type]
        __doc__ = __doc__

        def __init__(self, provider_name: str = PROVIDER_NAME, path_to_vm: str | None = None, *args: Any,
                     sandbox_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
            if provider_name not in (PROVIDER_NAME, "docker"):
                raise ValueError(f"SandboxDesktopEnv runs on the desktop sandbox (provider_name={PROVIDER_NAME!r}), "
                                 f"not {provider_name!r}")
            if kwargs.setdefault("require_a11y_tree", False) and a11y.unavailable():
                raise ValueError(f"require_a11y_tree=True: this machine cannot serve the accessibility tree "
                                 f"({a11y.unavailable()}; OSWorld's controller would retry /accessibility for 15 s "
                                 "at every observation)")
            screen = tuple(kwargs.get("screen_size") or (1920, 1080))
            # DesktopEnv accepts only its own provider names; "docker" makes both builds start the
            # emulator lazily or at once without a VM image, and the factory hands over ours.
            _PENDING.options = {"screen_size": screen, "sandbox_options": sandbox_options}
            try:
                super().__init__("docker", *args, path_to_vm=path_to_vm or PATH_TO_VM, **kwargs)
            finally:
                _PENDING.options = None
            self.provider_name = PROVIDER_NAME

        def reset(self, task_config: Any = None, *args: Any, **kwargs: Any) -> Any:
            """OSWorld's reset, then, where the set-up started something, a wait until the desktop
            is still (a VM's first screenshot comes long after its set-up; here the set-up returns
            within a second, before a browser has drawn anything) and a fresh observation; and
            what the set-up did not do (`setup_failures`)."""
            started = time.monotonic()
            self.provider.last_revert = {}
            obs = super().reset(task_config, *args, **kwargs)
            steps = (task_config or {}).get("config", []) if isinstance(task_config, dict) else []
            self.settle_s = 0.0
            if any(step.get("type") in SETTLING_STEPS for step in steps):
                self.settle_s = self.sandbox.settle(SETTLE_TIMEOUT_S, SETTLE_QUIET_S)
                obs = self._get_obs()
            self.setup_failures = setup_failures(self.sandbox, steps)
            total = time.monotonic() - started
            desktop = self.provider.last_revert.get("desktop_s", 0.0)
            self.reset_timings = {"reset_s": round(total, 3), "desktop_s": desktop,
                                  "setup_s": round(total - desktop - self.settle_s, 3), "settle_s": round(self.settle_s, 3),
                                  "handed_over": self.provider.last_revert.get("handed_over", False),
                                  **{k: v for k, v in self.provider.last_revert.items() if k in ("session_s", "profiles_s")}}
            """Reset to first screenshot, split: the desktop's part (the revert: a fresh desktop; in
            place, its session's reset and the home's application profiles), the task's set-up (with
            the first screenshot) and the wait for the desktop to be still."""
            return obs

        def step(self, action: Any, *args: Any, **kwargs: Any) -> Any:
            """OSWorld's step, with the agent's pyautogui code sent to /run_action (checked) rather
            than /execute (anything). A refused action is returned in info as `action_error`."""
            controller = self.controller
            refused: list[str] = []
            crashed: list[str] = []
            controller.execute_python_command = lambda command: _run_checked(controller, command, refused, crashed)
            try:
                result = super().step(action, *args, **kwargs)
            finally:
                del controller.execute_python_command  # the getters' probes go to /execute again
            if isinstance(result, tuple) and len(result) == 4 and isinstance(result[3], dict):
                if refused:
                    result[3]["action_error"] = "; ".join(refused)
                if crashed:  # the task's application is gone: the machine's failure, not the agent's
                    result[3]["crashed"] = crashed
            return result

        @property
        def sandbox(self) -> Sandbox | None:
            """The running sandbox (None before the first start and after close)."""
            return self.provider.box

    SandboxDesktopEnv.__name__ = SandboxDesktopEnv.__qualname__ = "SandboxDesktopEnv"
    SandboxDesktopEnv.__module__ = __name__
    return SandboxDesktopEnv


SETTLING_STEPS = ("launch", "open", "execute", "command", "execute_with_verification", "chrome_open_tabs",
                  "activate_window", "close_window")
"""Set-up steps after which the desktop may still be drawing."""


def setup_failures(box: Sandbox, steps: list[dict[str, Any]]) -> list[str]:
    """What the task's set-up did not do, in words: the server's report of its calls (a command
    that failed, a window that was not there, a program that died: server.Desktop.setup_report)
    and the files its download steps were to write that are not there (OSWorld's set-up logs a
    failed download and goes on)."""
    failures = list(box.get_json("/setup/report")["failures"])
    wanted = [f["path"] for step in steps if step.get("type") == "download"
              for f in (step.get("parameters") or {}).get("files", []) if isinstance(f, dict) and f.get("path")]
    if wanted:
        found = box.path_info(wanted)
        failures += [f"download {path}: the file was not written" for path in wanted if not found.get(path)]
    return failures


def _run_checked(controller: Any, command: str, refused: list[str], crashed: list[str]) -> dict[str, Any] | None:
    """What PythonController.execute_python_command does, through /run_action; what it refused goes
    to `refused`, the task's applications that crashed by the time it ran to `crashed`."""
    request = urllib.request.Request(f"{controller.http_server}/run_action", method="POST",
                                     data=json.dumps({"code": command}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
            crashed.extend(answer.get("crashed") or [])
            return answer
    except urllib.error.HTTPError as e:
        try:
            answer = json.loads(e.read())
        except ValueError:
            answer = {"error": f"HTTP {e.code}"}
        refused.append(str(answer.get("error", e.code)))
        return {"status": "refused" if e.code == 403 else "error", "output": "", "error": answer.get("error", ""),
                "returncode": -1}
    except OSError as e:
        refused.append(f"the action server did not answer: {e}")
        return None


def __getattr__(name: str) -> Any:
    """`SandboxDesktopEnv` is built on first use: importing this module needs no desktop_env."""
    if name == "SandboxDesktopEnv":
        cls = _make_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
