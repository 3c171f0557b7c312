"""MiniWoB++ tasks in headless Chromium, as a `GUIEnv` for screenshot-driven UI-TARS agents.

This wraps Farama's `miniwob` package rather than reimplementing it: its `MiniWoBEnvironment`
loads the task page, seeds it, executes coordinate/keyboard actions through Selenium and reads
the task's own reward. What this module adds, and where it departs from the package defaults:

- High-resolution screenshots. The package renders at 1x (160x210 px, too small for a VLM);
  we start Chrome with `--force-device-scale-factor=<scale>` and grab
  `driver.get_screenshot_as_png()` cropped to the task area (480x630 at scale 3). The package
  has no option for extra Chrome flags, so `_extra_chrome_args` swaps the `webdriver` name that
  `miniwob.selenium_instance` uses for a proxy whose `ChromeOptions()` carries our flags, only
  while *our* environment creates its driver (under a lock; the module is restored afterwards).
- UI-TARS actions. Points arrive in screenshot pixels and are divided by `scale` (CSS px, the
  unit of miniwob's coordinates and of `getBoundingClientRect`); the task area starts at CSS
  (0, 0) so no offset is needed. Points outside the task area are clipped into it.
  Right click and horizontal scroll are not miniwob actions: they go through Selenium's
  ActionChains directly, followed by a no-op miniwob step to read the task state.
- No wall-clock punishment: every task has a ~10 s JS timer that ends the episode with -1; we
  raise `core.EPISODE_MAX_TIME` (milliseconds) once per page load, which persists across resets.
- Reward without the package's time penalty: `raw` is the task's score in [-1, 1],
  `binary` is 1.0 if raw > 0 else 0.0. `finished`/`call_user`/`error_env` end the episode without reward
  unless the task's own checker had already ended it with success.
- The package returns a black screen once the task ends; we keep the last real screenshot.
- A step cap (`max_steps`) sets `truncated`, which the package never does.

Importing this module does not import selenium or miniwob (they load when an env is built), so
the pure helpers (`to_miniwob_key`, `ALLOWED_KEYS`) work on machines without a browser.
"""
from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.util
import io
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from PIL import Image

from arpo_lib.actions import Action
from arpo_lib.envs.base import EnvError, GUIEnv, Observation
from arpo_lib.envs.miniwob.browser import FIX, BrowserNotFoundError, find_browser  # noqa: F401 (re-exported)

TASK_WIDTH, TASK_HEIGHT = 160, 210
"""MiniWoB task area in CSS px, including the 50 px instruction bar at the top."""
BROWSER_CHROME_HEIGHT = 143
"""Height (DIP) Chrome's window loses to its own UI even in headless mode: the window must be
taller than the task by this much or clicks on the lower part raise MoveTargetOutOfBounds."""
WINDOW_WIDTH, WINDOW_HEIGHT = 500, TASK_HEIGHT + BROWSER_CHROME_HEIGHT + 67
"""Chrome window in DIP (500 is also Chrome's minimum width); the viewport gets 277 CSS px."""
SCROLL_AMOUNT_CSS = 50
"""CSS px per scroll action (miniwob's default wheel delta)."""
MAX_JS_TIMEOUT_MS = 2**31 - 1
"""setTimeout fires immediately for delays above this, which would end every episode at once."""

SETUP_HINT = FIX
"""What to do when the browser is missing (arpo_lib/envs/miniwob/browser.py finds it)."""


# --------------------------------------------------------------------------------------------
# Task list (read from the package's registration file: no import of miniwob needed)
# --------------------------------------------------------------------------------------------

@functools.cache
def miniwob_tasks() -> tuple[str, ...]:
    """Names of the MiniWoB++ tasks the installed package registers (FlightWoB excluded: those
    need an HTTP server and a different page size). Empty if miniwob is not installed."""
    spec = importlib.util.find_spec("miniwob")  # locates the package without executing it
    if spec is None or not spec.submodule_search_locations:
        return ()
    registration = Path(list(spec.submodule_search_locations)[0]) / "registration.py"
    ids = re.findall(r'id="miniwob/([^"]+)-v1"', registration.read_text())
    return tuple(sorted(t for t in ids if not t.startswith("flight.")))


def check_task(task: str) -> str:
    """Return the canonical task name (a gymnasium id `miniwob/<task>-v1` is accepted too), or
    raise ValueError listing close matches."""
    tasks = miniwob_tasks()
    if not tasks:
        raise BrowserNotFoundError(f"The `miniwob` package is not installed. {SETUP_HINT}")
    name = task.removeprefix("miniwob/").removesuffix("-v1")
    if name in tasks:
        return name
    close = difflib.get_close_matches(name, tasks, n=5, cutoff=0.5)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    raise ValueError(
        f"Unknown MiniWoB task {task!r}.{hint} {len(tasks)} tasks exist, e.g. "
        f"{', '.join(tasks[:8])}, ... (see arpo_lib.envs.list_envs('miniwob'))."
    )


# --------------------------------------------------------------------------------------------
# Keys: UI-TARS names -> miniwob's PRESS_KEY syntax ("C-a", "S-<Tab>", "<Enter>")
# --------------------------------------------------------------------------------------------

_MODIFIERS = {
    "ctrl": "C-", "control": "C-",
    # A macOS shortcut means the same on the Linux browser we run, so cmd maps to ctrl.
    "cmd": "C-", "command": "C-",
    "shift": "S-",
    "alt": "A-", "option": "A-",
    "meta": "M-", "win": "M-", "windows": "M-", "super": "M-",
}
_MODIFIER_ORDER = ("C-", "S-", "A-", "M-")  # one canonical spelling per combination
_SPECIAL_KEYS = {
    "enter": "<Enter>", "return": "<Enter>",
    "tab": "<Tab>",
    "backspace": "<Backspace>",
    "delete": "<Delete>", "del": "<Delete>",
    "escape": "<Escape>", "esc": "<Escape>",
    "space": "<Space>", "spacebar": "<Space>",
    "up": "<ArrowUp>", "arrowup": "<ArrowUp>",
    "down": "<ArrowDown>", "arrowdown": "<ArrowDown>",
    "left": "<ArrowLeft>", "arrowleft": "<ArrowLeft>",
    "right": "<ArrowRight>", "arrowright": "<ArrowRight>",
    "home": "<Home>", "end": "<End>",
    "pageup": "<PageUp>", "pgup": "<PageUp>",
    "pagedown": "<PageDown>", "pgdn": "<PageDown>",
    "insert": "<Insert>",
    **{f"f{i}": f"<F{i}>" for i in range(1, 13)},
}
_NAVIGATION = ("<ArrowLeft>", "<ArrowRight>", "<ArrowUp>", "<ArrowDown>", "<Home>", "<End>")
_SPECIALS = sorted(set(_SPECIAL_KEYS.values()))

ALLOWED_KEYS: tuple[str, ...] = tuple(dict.fromkeys(
    [chr(c) for c in range(33, 127)]                       # every printable character
    + _SPECIALS                                            # enter, tab, arrows, F-keys...
    + ["S-" + k for k in _SPECIALS]                        # shift+tab, shift+arrow selection
    + ["C-" + c for c in "acvxzy"] + ["C-S-z"]             # select all, clipboard, undo/redo
    + ["C-" + k for k in (*_NAVIGATION, "<Backspace>", "<Delete>", "<Enter>")]
    + ["C-S-" + k for k in _NAVIGATION]                    # word/line-wise selection
))
"""Key combinations PRESS_KEY accepts. Deliberately not every combination: browser-level
shortcuts (ctrl+w, ctrl+t, alt+f4...) have no business in a MiniWoB task."""


def to_miniwob_key(keys: list[str] | str) -> str | None:
    """Translate a UI-TARS hotkey ('ctrl c', ['ctrl', 'c'], 'Enter', 'pagedown', 'shift+tab')
    into miniwob's key syntax ('C-c', '<Enter>', '<PageDown>', 'S-<Tab>'); None if impossible
    (no key, several non-modifier keys, an unknown name). The result may still be outside
    `ALLOWED_KEYS`."""
    parts = [keys] if isinstance(keys, str) else list(keys)
    tokens: list[str] = []
    for part in parts:
        for token in part.split():
            # "ctrl+c" -> ctrl, c; a lone "+" is the plus key.
            tokens.extend([t for t in token.split("+") if t] if len(token) > 1 else [token])
    modifiers: set[str] = set()
    main: list[str] = []
    for token in tokens:
        name = token.lower().replace("_", "").replace("-", "") if len(token) > 1 else token
        if name in _MODIFIERS:
            modifiers.add(_MODIFIERS[name])
        elif name in _SPECIAL_KEYS:
            main.append(_SPECIAL_KEYS[name])
        elif len(token) == 1:
            main.append(token)
        else:
            return None
    if not main and modifiers == {"S-"}:
        return None  # a lone modifier press does nothing in a page
    if len(main) != 1:
        return None
    key = main[0]
    if len(key) == 1 and key.isalpha():
        if modifiers == {"S-"}:
            return key.upper()  # shift+a means the character "A"
        if modifiers:
            key = key.lower()  # ctrl+A is ctrl+a
    return "".join(m for m in _MODIFIER_ORDER if m in modifiers) + key


# --------------------------------------------------------------------------------------------
# Chrome set-up
# --------------------------------------------------------------------------------------------

def ensure_chromium() -> tuple[str, str]:
    """Point miniwob at a Chrome and a chromedriver of its version (MINIWOB_CHROME_BINARY /
    MINIWOB_CHROMEDRIVER, else found by `browser.find_browser`: PATH, Google Chrome's .deb,
    Selenium Manager's cache; without them Selenium would try to download a driver over the network)."""
    found = find_browser()
    os.environ["MINIWOB_CHROME_BINARY"], os.environ["MINIWOB_CHROMEDRIVER"] = found.binary, found.driver
    return found.binary, found.driver


def chrome_args(scale: int) -> list[str]:
    """Chrome flags we add to miniwob's own (headless, disable-gpu, no-sandbox)."""
    return [
        f"--force-device-scale-factor={scale}",
        f"--window-size={WINDOW_WIDTH},{WINDOW_HEIGHT}",
        "--disable-dev-shm-usage",  # /dev/shm is small in containers: tabs crash without this
        "--hide-scrollbars",
        # With sub-pixel glyph positioning each browser settled on one of two renderings of the
        # same text (login-user's Login button: 2 variants over 9 browsers, fixed for a browser's
        # life), so the same seed gave different screenshots, demonstrations and warm starts
        # depending on which browser ran it. Off: 27 browsers out of 27 drew the same pixels.
        "--disable-font-subpixel-positioning",
        # The network is closed: stop Chrome from trying (and waiting on) background fetches.
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
    ]


_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _extra_chrome_args(args: list[str]) -> Iterator[None]:
    """While active, drivers created by miniwob.selenium_instance get `args` added.

    `SeleniumInstance.create_driver` builds `webdriver.ChromeOptions()` with no hook for extra
    flags; copying that method would fork the package, so we swap the module-level `webdriver`
    name it resolves for a proxy (everything else delegates to the real module) and restore it.
    """
    import miniwob.selenium_instance as selenium_instance

    real = selenium_instance.webdriver

    class _WebdriverWithArgs:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def ChromeOptions() -> Any:  # noqa: N802 (mirrors selenium's name)
            options = real.ChromeOptions()
            for arg in args:
                options.add_argument(arg)
            return options

    with _PATCH_LOCK:
        selenium_instance.webdriver = _WebdriverWithArgs()
        try:
            yield
        finally:
            selenium_instance.webdriver = real


# The blinking text caret made a screenshot depend on when it was taken (measured: the same page
# hashed differently every ~0.5 s after focusing a field), so rollouts and evaluations were not
# reproducible for a seed. The caret is hidden; focus stays visible through the focus outline.
HIDE_CARET_JS = (
    "if (!document.getElementById('arpo-no-caret')) {"
    " var s = document.createElement('style'); s.id = 'arpo-no-caret';"
    " s.textContent = '* { caret-color: transparent !important; }';"
    " document.head.appendChild(s); }"
)


# An image the page has not finished loading is drawn as nothing: click-dialog's close button
# was screenshotted without its "x" icon (a CSS background sprite) in 3 of ~4,800 episodes of the
# learning experiment, at different episodes in two runs of the same seed (docs/learning.md,
# section 6). Before a screenshot, every image the page shows (<img>, CSS backgrounds, also of
# ::before/::after) and its fonts are awaited; when all are there already (nearly always) the
# callback runs at once, so the screenshot is taken no later than before. Bounded: 5 s at most.
AWAIT_IMAGES_JS = """
const done = arguments[arguments.length - 1];
const urls = new Set();
for (const el of document.querySelectorAll('*')) {
  for (const pseudo of [null, '::before', '::after']) {
    const bg = getComputedStyle(el, pseudo).backgroundImage;
    if (bg && bg !== 'none') for (const m of bg.matchAll(/url\\(["']?([^"')]+)["']?\\)/g)) urls.add(m[1]);
  }
}
const pending = [];
for (const url of urls) {
  const img = new Image();
  img.src = url;
  if (!img.complete) pending.push(new Promise(r => { img.onload = img.onerror = r; }));
}
for (const img of document.images) {
  if (!img.complete) pending.push(new Promise(r => { img.addEventListener('load', r); img.addEventListener('error', r); }));
}
if (document.fonts && document.fonts.status !== 'loaded') pending.push(document.fonts.ready);
if (!pending.length) { done(0); } else {
  const frame = () => new Promise(r => { requestAnimationFrame(() => r()); setTimeout(r, 100); });
  Promise.race([Promise.all(pending), new Promise(r => setTimeout(r, 5000))])
    .then(frame).then(frame).then(() => done(pending.length));
}
"""


@functools.cache
def _environment_class() -> type:
    """miniwob's MiniWoBEnvironment, with our Chrome flags and timer applied on every (re)start."""
    from miniwob.environment import MiniWoBEnvironment

    class _HiResMiniWoBEnvironment(MiniWoBEnvironment):
        def __init__(self, *args: Any, chrome_args: list[str], episode_max_time_ms: int,
                     **kwargs: Any) -> None:
            self._chrome_args = chrome_args
            self._episode_max_time_ms = episode_max_time_ms
            super().__init__(*args, **kwargs)

        def _hard_reset_instance(self) -> None:
            # Called at construction and whenever the package restarts a dead browser.
            try:
                with _extra_chrome_args(self._chrome_args):
                    super()._hard_reset_instance()
                # core.EPISODE_MAX_TIME lives in the page: set it again after each page load.
                self.instance.driver.execute_script(
                    f"core.EPISODE_MAX_TIME = {self._episode_max_time_ms};")
                self.instance.driver.execute_script(HIDE_CARET_JS)
            except BaseException:
                # A driver that started but failed later (page load timeout) must not leak.
                driver = getattr(getattr(self, "instance", None), "driver", None)
                if driver is not None:
                    with contextlib.suppress(Exception):
                        driver.quit()
                raise

    return _HiResMiniWoBEnvironment


def _browser_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean the browser or driver failed (not the policy)."""
    from selenium.common.exceptions import WebDriverException
    from urllib3.exceptions import HTTPError

    return (WebDriverException, HTTPError, ConnectionError)


# --------------------------------------------------------------------------------------------
# The environment
# --------------------------------------------------------------------------------------------

class MiniWoBEnv(GUIEnv):
    """One MiniWoB++ task in one headless Chromium, speaking UI-TARS actions.

    `reset`/`step` return `Observation(screenshot=(160*scale x 210*scale) RGB image,
    instruction=utterance)`; info carries 'raw_reward', 'task_done', 'reason', 'action_error'
    (None or why the action was a no-op) and 'dom_elements' (dicts with tag, text, value, ref,
    id, classes, left/top/width/height in screenshot pixels, focused/tampered/is_leaf flags).
    """

    def __init__(
        self,
        task: str,
        *,
        scale: int = 3,
        reward: str = "binary",
        max_steps: int = 15,
        wait_seconds: float = 0.3,
        episode_max_time_s: float = 1e6,
        headless: bool = True,
    ) -> None:
        """Start Chromium on `task` (e.g. "click-button"). See the module docstring."""
        if not (isinstance(scale, int) and 1 <= scale <= 8):
            raise ValueError(f"scale must be an int in [1, 8], got {scale!r}")
        if reward not in ("binary", "raw"):
            raise ValueError(f"reward must be 'binary' or 'raw', got {reward!r}")
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if episode_max_time_s <= 0:
            raise ValueError(f"episode_max_time_s must be > 0, got {episode_max_time_s}")
        self.task = check_task(task)
        self.name = f"miniwob/{self.task}"
        self.scale = scale
        self.reward_mode = reward
        self.max_steps = max_steps
        self.wait_seconds = wait_seconds
        self.episode_max_time_ms = min(int(episode_max_time_s * 1000), MAX_JS_TIMEOUT_MS)
        self.screen_size = (TASK_WIDTH * scale, TASK_HEIGHT * scale)
        """(width, height) of every screenshot, in pixels."""

        ensure_chromium()
        from miniwob.action import ActionSpaceConfig, ActionTypes

        self._types = ActionTypes
        self._action_config = ActionSpaceConfig(
            action_types=[
                ActionTypes.NONE, ActionTypes.MOVE_COORDS, ActionTypes.CLICK_COORDS,
                ActionTypes.DBLCLICK_COORDS, ActionTypes.MOUSEDOWN_COORDS,
                ActionTypes.MOUSEUP_COORDS, ActionTypes.SCROLL_UP_COORDS,
                ActionTypes.SCROLL_DOWN_COORDS, ActionTypes.PRESS_KEY, ActionTypes.TYPE_TEXT,
            ],
            allowed_keys=ALLOWED_KEYS,
            scroll_amount=SCROLL_AMOUNT_CSS,
            text_max_len=10_000,  # UI-TARS may type long text; the package's 64 is a space bound
        )
        self._errors = _browser_errors()
        self._env: Any = None
        try:
            self._env = _environment_class()(
                subdomain=self.task,
                render_mode=None if headless else "human",
                action_space_config=self._action_config,
                chrome_args=chrome_args(scale),
                episode_max_time_ms=self.episode_max_time_ms,
            )
        except self._errors as e:
            self.close()
            raise EnvError(f"Chromium failed to start for {self.name}: {e}") from e
        inner_h = self._env.instance.inner_height
        if inner_h < TASK_HEIGHT:
            self.close()
            raise EnvError(f"Browser viewport is {inner_h} CSS px tall, the task needs {TASK_HEIGHT}")
        self._episode_over = True  # until reset
        self._broken = False
        self._steps = 0
        self._utterance = ""
        self._screen: Image.Image | None = None
        self._dom: list[dict[str, Any]] = []
        self.images_awaited = 0
        """How many images, over this environment's life, a screenshot had to wait for."""

    # ---- GUIEnv --------------------------------------------------------------------------

    def reset(self, seed: int | None = None) -> tuple[Observation, dict[str, Any]]:
        """Start a new episode; the same seed gives the same task instance."""
        self._check_open()
        try:
            if self._broken:  # the last error may have left a dead browser: start a fresh one
                self._env._hard_reset_instance()
                self._broken = False
            # record_screenshots=False: we take our own high-resolution screenshot instead.
            obs, _ = self._env.reset(seed=seed, options={"record_screenshots": False})
            self._screen = self._grab_screen()
        except (*self._errors, RuntimeError) as e:  # RuntimeError: miniwob's "does not load"
            self._broken = True
            raise EnvError(f"{self.name}: browser failed during reset: {e}") from e
        self._steps = 0
        self._episode_over = False
        self._utterance = obs["utterance"]
        self._dom = self._dom_elements(obs)
        info = {"raw_reward": 0.0, "task_done": False, "reason": None, "action_error": None,
                "dom_elements": self._dom}
        return Observation(self._screen, self._utterance, 0), info

    def _step(self, action: Action) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        """Execute one UI-TARS action (points in screenshot pixels)."""
        try:
            obs, meta, error = self._execute(action)
            done = bool(meta["done"])
            if not done:
                # Once the task ends the page shows its START cover (miniwob returns black):
                # keep the last real screen, i.e. the one this action was taken on.
                self._screen = self._grab_screen()
                self._dom = self._dom_elements(obs)
        except self._errors as e:
            self._broken = self._episode_over = True
            raise EnvError(f"{self.name}: browser failed during {action.kind}: {e}") from e

        raw = float(meta["raw_reward"]) if done else 0.0
        reward = raw if self.reward_mode == "raw" else float(raw > 0)
        terminated = done or action.kind in ("finished", "call_user", "error_env")
        truncated = not terminated and self._steps >= self.max_steps
        self._episode_over = terminated or truncated
        info = {"raw_reward": raw, "task_done": done, "reason": meta.get("reason"),
                "action_error": error, "dom_elements": self._dom}
        return Observation(self._screen, self._utterance, self._steps), reward, terminated, truncated, info

    def close(self) -> None:
        """Quit Chromium. Safe to call twice."""
        env, self._env = self._env, None
        if env is not None:
            with contextlib.suppress(Exception):
                env.close()

    # ---- helpers --------------------------------------------------------------------------

    @property
    def driver(self) -> Any:
        """The Selenium WebDriver (for tests and debugging)."""
        self._check_open()
        return self._env.instance.driver

    def _check_open(self) -> None:
        if self._env is None:
            raise RuntimeError(f"{self.name} is closed")

    def _execute(self, action: Action) -> tuple[dict, dict, str | None]:
        """Run `action` as one or more miniwob steps. Returns (last miniwob obs, task metadata,
        error message if the action was a no-op)."""
        T = self._types
        kind = action.kind
        needs_point = kind in ("click", "left_double", "right_single", "drag")
        if needs_point and action.point is None:
            return (*self._mw_step(T.NONE), f"{kind} needs a point")

        if kind == "click":
            return (*self._mw_step(T.CLICK_COORDS, coords=self._css(action.point)), None)
        if kind == "left_double":
            return (*self._mw_step(T.DBLCLICK_COORDS, coords=self._css(action.point)), None)
        if kind == "right_single":
            x, y = self._css(action.point)
            self._chain(lambda c: (c.w3c_actions.pointer_action.move_to_location(x, y),
                                   c.w3c_actions.pointer_action.context_click()))
            return (*self._mw_step(T.NONE), None)
        if kind == "drag":
            if action.end_point is None:
                return (*self._mw_step(T.NONE), "drag needs an end point")
            start, end = self._css(action.point), self._css(action.end_point)
            return (*self._mw_steps([(T.MOUSEDOWN_COORDS, {"coords": start}),
                                     (T.MOVE_COORDS, {"coords": end}),
                                     (T.MOUSEUP_COORDS, {"coords": end})]), None)
        if kind == "scroll":
            direction = (action.direction or "down").lower()
            point = action.point or (self.screen_size[0] / 2, self.screen_size[1] / 2)
            x, y = self._css(point)
            if direction in ("up", "down"):
                kind_ = T.SCROLL_UP_COORDS if direction == "up" else T.SCROLL_DOWN_COORDS
                return (*self._mw_step(kind_, coords=(x, y)), None)
            if direction in ("left", "right"):
                # miniwob only scrolls vertically: send a horizontal wheel event ourselves.
                dx = SCROLL_AMOUNT_CSS * (-1 if direction == "left" else 1)
                self._chain(lambda c: c.w3c_actions.wheel_action.scroll(
                    x=int(x), y=int(y), delta_x=dx, delta_y=0,
                    duration=self._action_config.scroll_time))
                return (*self._mw_step(T.NONE), None)
            return (*self._mw_step(T.NONE), f"unknown scroll direction {action.direction!r}")
        if kind == "type":
            # Newlines become Enter presses (typing "\n" into an <input> does not submit).
            steps: list[tuple[Any, dict]] = []
            for i, line in enumerate((action.text or "").split("\n")):
                if i:
                    steps.append((T.PRESS_KEY, {"key": ALLOWED_KEYS.index("<Enter>")}))
                if line:
                    steps.append((T.TYPE_TEXT, {"text": line}))
            return (*self._mw_steps(steps or [(T.NONE, {})]), None)
        if kind == "hotkey":
            keys = action.keys or ([action.text] if action.text else [])
            key = to_miniwob_key(keys)
            if key is None or key not in ALLOWED_KEYS:
                return (*self._mw_step(T.NONE), f"unsupported key combination {keys!r}")
            return (*self._mw_step(T.PRESS_KEY, key=ALLOWED_KEYS.index(key)), None)
        if kind == "wait":
            time.sleep(self.wait_seconds)
            return (*self._mw_step(T.NONE), None)
        if kind in ("finished", "call_user", "error_env"):
            return (*self._mw_step(T.NONE), None)  # read whether the task had already ended
        if kind == "noop":  # a call ARPO's action rules run as nothing
            return (*self._mw_step(T.NONE), None)
        return (*self._mw_step(T.NONE), f"unknown action kind {kind!r}")

    def _mw_step(self, action_type: Any, **fields: Any) -> tuple[dict, dict]:
        """One miniwob step; returns (observation, metadata with done/raw_reward/reason)."""
        action = {"action_type": self._action_config.action_types.index(action_type), **fields}
        obs, _, _, _, meta = self._env.step(action)
        return obs, meta

    def _mw_steps(self, steps: list[tuple[Any, dict]]) -> tuple[dict, dict]:
        """Several miniwob steps making up one UI-TARS action; stops early if the task ends."""
        for action_type, fields in steps:
            obs, meta = self._mw_step(action_type, **fields)
            if meta["done"]:
                break
        return obs, meta

    def _chain(self, build: Any) -> None:
        """Perform a Selenium action chain that miniwob has no action for."""
        from selenium.webdriver.common.action_chains import ActionChains

        chain = ActionChains(self._env.instance.driver, duration=0)
        build(chain)
        chain.w3c_actions.perform()

    def _css(self, point: tuple[float, float]) -> tuple[float, float]:
        """Screenshot pixels -> CSS px, clipped into the task area (an off-page point clicks its
        nearest edge instead of raising MoveTargetOutOfBounds)."""
        x, y = (float(v) / self.scale for v in point)
        return min(max(x, 0.0), TASK_WIDTH - 0.5), min(max(y, 0.0), TASK_HEIGHT - 0.5)

    def _grab_screen(self) -> Image.Image:
        """The task area from a device-scale screenshot, as (160*scale, 210*scale) RGB."""
        driver = self._env.instance.driver
        self.images_awaited += driver.execute_async_script(AWAIT_IMAGES_JS)
        png = driver.get_screenshot_as_png()
        image = Image.open(io.BytesIO(png)).convert("RGB")
        ratio = image.width / self._env.instance.inner_width  # device pixels per CSS px
        image = image.crop((0, 0, round(TASK_WIDTH * ratio), round(TASK_HEIGHT * ratio)))
        if image.size != self.screen_size:  # only if Chrome ignored the scale flag
            image = image.resize(self.screen_size, Image.BICUBIC)
        return image

    def _dom_elements(self, obs: dict) -> list[dict[str, Any]]:
        """miniwob's DOM elements as plain dicts, boxes in screenshot pixels."""
        s = self.scale
        elements = []
        for e in obs["dom_elements"]:
            focused, tampered, _targeted, is_leaf = (bool(f) for f in e["flags"])
            elements.append({
                "ref": int(e["ref"]), "parent": int(e["parent"]), "tag": e["tag"],
                "text": e["text"], "value": e["value"], "id": e["id"], "classes": e["classes"],
                "left": float(e["left"][0]) * s, "top": float(e["top"][0]) * s,
                "width": float(e["width"][0]) * s, "height": float(e["height"][0]) * s,
                "focused": focused, "tampered": tampered, "is_leaf": is_leaf,
            })
        return elements
