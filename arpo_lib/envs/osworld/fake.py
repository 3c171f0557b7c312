"""A stand-in for OSWorld's `desktop_env.desktop_env.DesktopEnv`: same API, no VM, no Docker.

`FakeDesktopEnv` has exactly the signatures of desktop-env 1.0.2's `__init__`, `reset`, `step`,
`evaluate` and `close` (tests compare them with the real source), so `OSWorldEnv` drives it the
way it drives the real class. Use it to dry-run the whole OSWorld pipeline (make_env, worker
processes, rollouts, evaluation, trajectory files) on a machine without Docker or KVM:

    make_env("osworld/fake-click", provider="fake", pause_s=0,
             desktop_env_class="arpo_lib.envs.osworld.fake:FakeDesktopEnv",
             task_loader="arpo_lib.envs.osworld.fake:load_fake_task")

(`provider="fake"`: the Docker preflight checks run only for provider "docker").

What it does instead of a VM:
- The screen is drawn with PIL: the instruction, the step number, the task's target box (if
  any), the clicks received so far and the text typed, returned as PNG bytes like the real
  controller's screenshot.
- Actions arrive as OSWorld receives them (pyautogui code or 'WAIT'/'DONE'/'FAIL'). The code is
  parsed with `ast` and never executed; clicks and typed text are remembered for scoring.
- `evaluate()` applies the task's `evaluator.func`: "fake_click_target" (1 if a click landed
  inside `evaluator.expected.box` = [x1, y1, x2, y2]), "fake_typed_text" (1 if the text typed so
  far contains `evaluator.expected.text`) or "infeasible" (1 if the last action was FAIL).
  As in OSWorld, a feasible task ending with FAIL scores 0. Real OSWorld checkers (a task JSON
  from the fetched data: `exact_match`, `compare_table`, lists of funcs, ...) need the VM's
  state, which the fake does not have: they score 0, so real task sets dry-run end to end.
- Every call is recorded in `FakeDesktopEnv.calls` (this process) and, when the task config says
  `"fake": {"log": PATH}`, appended to PATH as JSON lines (readable from another process, e.g.
  a test checking what an environment worker sent).

Fault injection, to exercise retries and infrastructure failures:
- task config `"fake": {...}`: `reset_failures: k` (the first k resets of this task id in this
  process raise ConnectionError), `die_at_step: j` with `die_mode: "raise"` (step j raises
  ConnectionError) or `"no_screenshot"` (step j returns a None screenshot, as the real controller
  does when the VM stopped answering; the VM stays dead), `hang_at_step: j` with `hang_s: s`
  (step j sleeps s seconds), `evaluate_fails: true` (evaluate raises ConnectionError),
  `checker_raises: true` (evaluate raises KeyError, as a checker missing its result file does;
  `checker_raises: k`: the first k evaluations of this task id in this process raise),
  `clipboard: false` (the VM has no clipboard tool: code that copies stops there, as `python -c`
  would on pyperclip's exception, and the clipboard probe says so), `setup_failures: [...]` (what
  the set-up did not do, as the sandbox provider reports it in its `setup_failures` attribute),
  `refuse_setup: true` (reset raises as desktop_env's SetupController does for a step type it
  does not know), `blank_at_step: j` (from step j on the screen is black, as a blanked or
  disconnected display shows it), `locked_at_step: j` (GNOME's lock screen comes up after step j,
  while the model thinks: the lock probe says so from then on), `focused: "instance.Class"` (the WM_CLASS of the focused window;
  in a terminal's, gnome-terminal-server's or st's, ctrl+v pastes nothing and ctrl+shift+v pastes,
  as there).
- `controller.execute_python_command` (OSWorld's PythonController, which the workbench calls
  directly for its probes): answers only the clipboard, focus and lock probes
  (`arpo_lib.envs.osworld.env.CLIPBOARD_PROBE`, `FOCUS_PROBE`, `LOCK_PROBE`).
- environment variable ARPO_FAKE_OSWORLD_BOOT_FAILURES=k: the first k constructions in this
  process raise ConnectionError (the real class boots the VM in its constructor).

Only the standard library and PIL are imported (no torch, no gymnasium).
"""
from __future__ import annotations

import ast
import copy
import io
import json
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, Optional, Tuple

from PIL import Image, ImageDraw, ImageFont

FAKE_DESKTOP_ENV = "arpo_lib.envs.osworld.fake:FakeDesktopEnv"
"""The `desktop_env_class` option that selects this fake."""
FAKE_TASK_LOADER = "arpo_lib.envs.osworld.fake:load_fake_task"
"""The `task_loader` option that serves `FAKE_TASKS`."""
BOOT_FAILURES_VAR = "ARPO_FAKE_OSWORLD_BOOT_FAILURES"
METRICS = ("fake_click_target", "fake_typed_text", "infeasible")
"""The evaluator functions the fake understands."""

FAKE_TASKS: dict[str, dict[str, Any]] = {
    "fake-click": {
        "id": "fake-click", "snapshot": "fake", "domain": "fake",
        "instruction": "Click the blue 'Submit' button.",
        "config": [], "related_apps": [],
        "evaluator": {"func": "fake_click_target", "result": {"type": "fake"},
                      "expected": {"type": "fake", "box": [860, 500, 1060, 580], "label": "Submit"}},
    },
    "fake-type": {
        "id": "fake-type", "snapshot": "fake", "domain": "fake",
        "instruction": "Type 'hello world' and press Enter.",
        "config": [], "related_apps": [],
        "evaluator": {"func": "fake_typed_text", "result": {"type": "fake"},
                      "expected": {"type": "fake", "text": "hello world"}},
    },
    "fake-infeasible": {
        "id": "fake-infeasible", "snapshot": "fake", "domain": "fake",
        "instruction": "Install the application 'Foo 3000' from the app store (it does not exist).",
        "config": [], "related_apps": [],
        "evaluator": {"func": "infeasible"},
    },
}
"""Built-in tasks in OSWorld's task-JSON shape (ids, instructions, evaluators)."""


def load_fake_task(task_id: str) -> dict[str, Any]:
    """A copy of `FAKE_TASKS[task_id]`; FileNotFoundError (the task loaders' contract) if unknown."""
    if task_id not in FAKE_TASKS:
        raise FileNotFoundError(f"no fake OSWorld task {task_id!r}; fake tasks: {', '.join(FAKE_TASKS)}")
    return copy.deepcopy(FAKE_TASKS[task_id])


class FakeController:
    """OSWorld's PythonController as far as the workbench uses it: `execute_python_command` answers
    the clipboard probe from the task's `"fake": {"clipboard": ...}` (default true), the focus
    probe from its `"focused"` (default: no window) and the lock probe from its `"locked_at_step"`
    (default: never), in the real server's answer format; any other
    command fails (the fake runs no code)."""

    def __init__(self, env: "FakeDesktopEnv") -> None:
        self.env = env
        self.commands: list[str] = []

    def execute_python_command(self, command: str) -> Dict[str, Any]:
        self.commands.append(command)
        self.env._check_alive()
        self.env._check_running("execute_python_command")
        if "determine_clipboard" in command:
            output = f"clipboard: {bool(self.env._fault('clipboard', True))}\n"
        elif "_NET_ACTIVE_WINDOW" in command:
            output = f"focus: {self.env._fault('focused', '')}\n"
        elif "org.gnome.ScreenSaver" in command:
            locked_from = self.env._fault("locked_at_step", None)
            output = f"locked: {locked_from is not None and self.env._step_no >= locked_from}\n"
        else:
            return {"status": "success", "output": "", "error": "the fake VM runs no code", "returncode": 1}
        return {"status": "success", "output": output, "error": "", "returncode": 0}


@dataclass
class FakeCall:
    """One recorded call on a `FakeDesktopEnv`."""

    instance: int
    """Serial number of the instance (0 for the first one built in this process)."""
    method: str
    """"__init__", "reset", "step", "evaluate" or "close"."""
    args: dict[str, Any] = field(default_factory=dict)
    """The arguments, by parameter name."""
    result: Any = None
    """What evaluate returned (None for the other methods)."""


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1 has only the small bitmap font
        return ImageFont.load_default()


def _literal_calls(code: str) -> list[tuple[str, list[Any]]]:
    """(function name, literal positional args) of each `pyautogui.<name>(...)` call in `code`
    (and `pyperclip.copy`, named "copy"), in order; parsed, never executed. Arguments that are
    not literals are skipped."""
    calls = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and node.func.value.id in ("pyautogui", "pyperclip"):
            args = []
            for arg in node.args:
                try:
                    args.append(ast.literal_eval(arg))
                except ValueError:
                    pass
            calls.append((node.func.attr, args))
    return calls


class FakeDesktopEnv:
    """OSWorld's `DesktopEnv` API without a VM (see the module docstring)."""

    calls: ClassVar[list[FakeCall]] = []
    """Every call on every instance in this process, in order."""
    instances: ClassVar[list["FakeDesktopEnv"]] = []
    """Every instance built (or attempted) in this process, in order."""
    _resets_by_task: ClassVar[dict[str, int]] = defaultdict(int)
    _evaluations_by_task: ClassVar[dict[str, int]] = defaultdict(int)
    downloads: ClassVar[list[str]] = []
    """URLs the fake set-ups "downloaded" (a file desktop-env finds in its cache is not fetched)."""

    @classmethod
    def clear(cls) -> None:
        """Forget all recorded calls, instances and fault counters (between tests)."""
        cls.calls.clear()
        cls.instances.clear()
        cls._resets_by_task.clear()
        cls._evaluations_by_task.clear()
        cls.downloads.clear()

    # The signatures below are desktop-env 1.0.2's, parameter for parameter (names, order,
    # defaults, including the env-dependent screen_size default): tests check them.
    def __init__(
            self,
            provider_name: str = "vmware",
            region: str = None,
            path_to_vm: str = None,
            snapshot_name: str = "init_state",
            action_space: str = "pyautogui",
            cache_dir: str = "cache",
            screen_size: Tuple[int] = (int(os.environ.get("SCREEN_WIDTH", 1920)),
                                       int(os.environ.get("SCREEN_HEIGHT", 1080))),
            headless: bool = False,
            require_a11y_tree: bool = True,
            require_terminal: bool = False,
            os_type: str = "Ubuntu",
            enable_proxy: bool = False,
            client_password: str = "",
    ) -> None:
        """Record the arguments and "boot" (fails while ARPO_FAKE_OSWORLD_BOOT_FAILURES allows)."""
        self.serial = len(FakeDesktopEnv.instances)
        FakeDesktopEnv.instances.append(self)
        self._log_path: str | None = None
        self._record("__init__", provider_name=provider_name, region=region, path_to_vm=path_to_vm,
                     snapshot_name=snapshot_name, action_space=action_space, cache_dir=cache_dir,
                     screen_size=tuple(screen_size), headless=headless,
                     require_a11y_tree=require_a11y_tree, require_terminal=require_terminal,
                     os_type=os_type, enable_proxy=enable_proxy, client_password=client_password)
        if action_space != "pyautogui":
            raise ValueError(f"the fake only speaks the 'pyautogui' action space, got {action_space!r}")
        if self.serial < int(os.environ.get(BOOT_FAILURES_VAR, "0")):
            raise ConnectionError(f"fake VM {self.serial} failed to boot (injected by {BOOT_FAILURES_VAR})")
        self.provider_name = provider_name
        self.cache_dir_base = cache_dir
        self.screen_width, self.screen_height = int(screen_size[0]), int(screen_size[1])
        self.require_a11y_tree = require_a11y_tree
        self.require_terminal = require_terminal
        self.task_config: dict[str, Any] | None = None
        self.cache_dir: str | None = None
        self.action_history: list[Any] = []
        self.clicks: list[tuple[int, int]] = []
        self.typed = ""
        self.clipboard = ""
        self.closed = False
        self.dead = False
        self.setup_failures: list[str] = []
        self.paused = False
        self._step_no = 0
        self.controller = FakeController(self)

    def reset(self, task_config: Optional[Dict[str, Any]] = None, seed=None, options=None) -> Dict[str, Any]:
        """Start the task (or restart the current one when `task_config` is None)."""
        log_path = ((task_config or {}).get("fake") or {}).get("log")
        if log_path and log_path != self._log_path:
            self._log_path = log_path
            for call in FakeDesktopEnv.calls:  # calls made before the log was known go first
                if call.instance == self.serial:
                    self._write(call)
        self._record("reset", task_config=task_config, seed=seed, options=options)
        self._check_alive()
        if task_config is not None:
            self.task_config = task_config
            self.cache_dir = os.path.join(self.cache_dir_base, task_config["id"])
            os.makedirs(self.cache_dir, exist_ok=True)
        if self.task_config is None:
            raise ValueError("reset() without a task_config before any task was set")
        self._check_running("reset")
        if self._fault("refuse_setup", False):
            raise AssertionError("Setup controller cannot find init function _no_such_step_setup")
        self.setup_failures = list(self._fault("setup_failures", []))
        self._download_setup()
        task_id = self.task_config["id"]
        FakeDesktopEnv._resets_by_task[task_id] += 1
        if FakeDesktopEnv._resets_by_task[task_id] <= self._fault("reset_failures", 0):
            raise ConnectionError(f"fake VM: task set-up of {task_id!r} failed (injected)")
        self._step_no = 0
        self.action_history.clear()
        self.clicks.clear()
        self.typed = ""
        return self._get_obs()

    def step(self, action, pause=2):
        """Apply one action (pyautogui code or 'WAIT'/'DONE'/'FAIL'); returns the gym 4-tuple
        (observation, 0, done, info) of the real class."""
        self._record("step", action=action, pause=pause)
        self._check_alive()
        self._check_running("step")
        self._step_no += 1
        self.action_history.append(action)
        if self._step_no == self._fault("hang_at_step", None):
            time.sleep(float(self._fault("hang_s", 3600.0)))
        if self._step_no == self._fault("die_at_step", None):
            self.dead = True
            if self._fault("die_mode", "raise") == "raise":
                raise ConnectionError(f"fake VM died at step {self._step_no} (injected)")
        done, info = False, {}
        if action == "FAIL":
            done, info = True, {"fail": True}
        elif action == "DONE":
            done, info = True, {"done": True}
        elif action != "WAIT":
            self._apply(action)
        return self._get_obs(), 0, done, info

    def evaluate(self):
        """The task's score from the fake metric named by `evaluator.func`."""
        self._check_alive()
        self._check_running("evaluate")
        raises = self._fault("checker_raises", False)
        if raises is not False:  # true: always; k: the first k evaluations of this task id
            task_id = self.task_config["id"]
            FakeDesktopEnv._evaluations_by_task[task_id] += 1
            if raises is True or FakeDesktopEnv._evaluations_by_task[task_id] <= raises:
                raise KeyError("fake checker: the result file is missing (injected)")
        if self._fault("evaluate_fails", False):
            raise ConnectionError("fake VM: the evaluator could not reach the VM (injected)")
        evaluator = self.task_config["evaluator"]
        last_fail = bool(self.action_history) and self.action_history[-1] == "FAIL"
        expected = evaluator.get("expected", {})
        if evaluator["func"] == "infeasible":
            score = float(last_fail)
        elif last_fail:
            score = 0.0
        elif evaluator["func"] == "fake_click_target":
            x1, y1, x2, y2 = expected["box"]
            score = float(any(x1 <= x <= x2 and y1 <= y <= y2 for x, y in self.clicks))
        elif evaluator["func"] == "fake_typed_text":
            score = float(expected["text"] in self.typed)
        else:  # a real OSWorld checker: it would read the VM's state, which the fake has not
            score = 0.0
        self._record("evaluate", result=score)
        return score

    def pause(self):
        """The ARPO fork's DesktopEnv.pause(): the VM's container is paused (no time passes in it)."""
        self._record("pause")
        self.paused = True

    def unpause(self):
        """The ARPO fork's DesktopEnv.unpause()."""
        self._record("unpause")
        self.paused = False

    def close(self):
        """Stop the fake VM. Safe to call twice, like the real one."""
        self._record("close")
        self.closed = True

    # ---- the fake VM ---------------------------------------------------------------------

    def _check_running(self, what: str) -> None:
        if self.paused:
            raise RuntimeError(f"fake VM: {what} on a paused VM (the container would not answer)")

    def _download_setup(self) -> None:
        """desktop-env's download set-up step: fetch each file into `<cache_dir>/<task id>/` under
        uuid5(url)_<basename> unless it is there already (here: write placeholder bytes)."""
        import uuid

        for step in self.task_config.get("config") or []:
            if step.get("type") != "download":
                continue
            for f in step.get("parameters", {}).get("files", []):
                path = os.path.join(self.cache_dir, f"{uuid.uuid5(uuid.NAMESPACE_URL, f['url'])}_{os.path.basename(f['path'])}")
                if not os.path.exists(path):
                    FakeDesktopEnv.downloads.append(f["url"])
                    with open(path, "wb") as fh:
                        fh.write(f"fake download of {f['url']}".encode())

    def _apply(self, code: str) -> None:
        """Remember clicks and typed text; code that is not valid Python changes nothing, as a
        failing `python -c` in the VM would."""
        try:
            calls = _literal_calls(code)
        except SyntaxError:
            return
        for name, args in calls:
            if name == "copy" and not self._fault("clipboard", True):
                return  # pyperclip raises: no clipboard tool, the rest of the code never runs
            if name in ("click", "doubleClick", "rightClick") and len(args) >= 2:
                self.clicks.append((int(args[0]), int(args[1])))
            elif name in ("write", "typewrite") and args and isinstance(args[0], str):
                self.typed += args[0]
            elif name == "copy" and args and isinstance(args[0], str):
                self.clipboard = args[0]
            elif name == "hotkey" and [str(a).lower() for a in args] == self._paste_keys():
                self.typed += self.clipboard
            elif name == "hotkey" and [str(a).lower() for a in args] == ["shift", ","]:
                self.typed += "<"  # the VM's US layout
            elif name == "press" and args == ["enter"]:
                self.typed += "\n"

    def _paste_keys(self) -> list[str]:
        """What pastes in the focused window: ctrl+shift+v in a terminal (ctrl+v is the shell's
        quoted-insert there), ctrl+v elsewhere."""
        focused = str(self._fault("focused", "")).lower()
        terminal = focused.split(".", 1)[0] in ("gnome-terminal-server", "st-256color", "st")
        return ["ctrl", "shift", "v"] if terminal else ["ctrl", "v"]

    def _get_obs(self) -> Dict[str, Any]:
        return {
            "screenshot": None if self.dead else self._render(),
            "accessibility_tree": self._a11y_tree() if self.require_a11y_tree else None,
            "terminal": "" if self.require_terminal else None,
            "instruction": self.task_config["instruction"],
        }

    def _render(self) -> bytes:
        """The fake screen as PNG bytes: instruction, step, target box, clicks, typed text."""
        w, h = self.screen_width, self.screen_height
        blank_from = self._fault("blank_at_step", None)
        if blank_from is not None and self._step_no >= blank_from:
            image = Image.new("RGB", (w, h), (0, 0, 0))
        else:
            image = self._drawn(w, h)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", compress_level=1)
        return buffer.getvalue()

    def _drawn(self, w: int, h: int) -> Image.Image:
        image = Image.new("RGB", (w, h), (236, 239, 244))
        draw = ImageDraw.Draw(image)
        scale = max(h / 1080, 0.3)
        draw.rectangle((0, 0, w, int(60 * scale)), fill=(46, 52, 64))
        draw.text((int(20 * scale), int(14 * scale)), self.task_config["instruction"],
                  fill=(236, 239, 244), font=_font(int(28 * scale)))
        draw.text((int(20 * scale), h - int(50 * scale)), f"step {self._step_no}",
                  fill=(46, 52, 64), font=_font(int(24 * scale)))
        expected = self.task_config["evaluator"].get("expected", {})
        if "box" in expected:
            draw.rectangle(tuple(expected["box"]), fill=(94, 129, 172), outline=(46, 52, 64), width=3)
            x1, y1, _, _ = expected["box"]
            draw.text((x1 + int(12 * scale), y1 + int(20 * scale)), expected.get("label", "target"),
                      fill="white", font=_font(int(28 * scale)))
        if self.typed:
            draw.text((int(20 * scale), int(100 * scale)), self.typed, fill=(46, 52, 64),
                      font=_font(int(28 * scale)))
        r = max(int(8 * scale), 3)
        for x, y in self.clicks:
            draw.ellipse((x - r, y - r, x + r, y + r), outline=(191, 97, 106), width=3)
        return image

    def _a11y_tree(self) -> str:
        expected = self.task_config["evaluator"].get("expected", {})
        box = expected.get("box")
        node = (f'<push-button name="{expected.get("label", "target")}" '
                f'screencoord="({box[0]}, {box[1]})" size="({box[2] - box[0]}, {box[3] - box[1]})"/>'
                if box else "")
        return f'<desktop-frame name="fake">{node}</desktop-frame>'

    def _fault(self, name: str, default: Any) -> Any:
        return ((self.task_config or {}).get("fake") or {}).get(name, default)

    def _check_alive(self) -> None:
        if self.closed:
            raise ConnectionError(f"fake VM {self.serial} is closed")
        if self.dead and self._fault("die_mode", "raise") == "raise":
            raise ConnectionError(f"fake VM {self.serial} is dead")

    def _record(self, method: str, result: Any = None, **args: Any) -> None:
        call = FakeCall(self.serial, method, args, result)
        FakeDesktopEnv.calls.append(call)
        if self._log_path:
            self._write(call)

    def _write(self, call: FakeCall) -> None:
        args = dict(call.args)
        if isinstance(args.get("task_config"), dict):
            args["task_config"] = {"id": args["task_config"].get("id")}
        line = {"instance": call.instance, "method": call.method, "args": args, "result": call.result}
        with open(self._log_path, "a") as f:
            f.write(json.dumps(line, default=str) + "\n")
