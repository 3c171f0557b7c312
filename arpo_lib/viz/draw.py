"""Look at trajectories, as pictures: actions drawn on screenshots, filmstrips, group figures.

Pure renderers (no widgets, no display; `arpo_lib.viz.widgets` wraps them for notebooks):

1. Pure drawing: :func:`draw_actions` returns a new image with a UI-TARS action drawn on it
   (click rings, drag arrows, scroll arrows, typed-text and hotkey labels, corner badges).
2. Loading: :func:`load_frames` turns a trajectory directory (OSWorld layout, read by the
   trajectory store :mod:`arpo_lib.rollout.store`) into one :class:`Frame` per step plus a final
   result frame; :func:`load_group` / :func:`list_groups` read the trainer's ``groups.json``.
3. Static matplotlib figures (:func:`filmstrip`, :func:`group_figure`) that survive in a saved
   or papermill-executed notebook.

Figures are built with the object-oriented ``matplotlib.figure.Figure`` (never pyplot), so they
are headless, never registered with a GUI backend, and cannot be shown twice by the inline
backend; the ``show_*`` helpers display them as PNG images.

Text is drawn with matplotlib's bundled DejaVu Sans when present (Pillow's default font lacks
glyphs such as the ``⏎`` used for escaped newlines), else Pillow's default font.
"""
from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from PIL import Image, ImageDraw, ImageFont

from arpo_lib.actions import Action
from arpo_lib.rollout.store import TrajectoryFormatError, read_trajectory
from arpo_lib.run import layout
from arpo_lib.run.layout import RunDir

# Colours (RGB). Tests look for these exact values near the drawn positions.
CLICK_COLOUR = (255, 32, 32)
DOUBLE_CLICK_COLOUR = (255, 0, 200)
RIGHT_CLICK_COLOUR = (0, 110, 255)
DRAG_COLOUR = (255, 150, 0)
SCROLL_COLOUR = (150, 0, 255)
TYPE_COLOUR = (0, 170, 60)
HOTKEY_COLOUR = (0, 150, 190)
BADGE_COLOURS = {
    "wait": (110, 110, 110),
    "finished": (0, 150, 60),
    "call_user": (230, 120, 0),
    "error_env": (230, 120, 0),
    "format_error": (200, 0, 0),
}
REPLAYED_COLOUR = "#d62728"
"""Border/title colour of rollouts that came from the replay buffer."""
MAX_LABEL_CHARS = 40
"""Typed text longer than this is truncated in the drawn label."""
WIDGET_MAX_WIDTH = 480
"""Frames sent to the Image widget are downscaled to at most this width (keeps notebooks small)."""

_ACTION_LABEL = re.compile(r"^[ \t]*Action[ \t]*:", re.MULTILINE)
_THOUGHT_LABEL = re.compile(r"(?:Thought|Reflection|Action_Summary)[ \t]*:")


# =========================================================================== pure drawing

@functools.lru_cache(maxsize=32)
def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    """A font of about ``size`` pixels (cached: fonts are loaded for every frame drawn)."""
    try:
        import matplotlib

        path = os.path.join(matplotlib.get_data_path(), "fonts", "ttf", "DejaVuSans.ttf")
        if os.path.isfile(path):
            return ImageFont.truetype(path, size)
    except (ImportError, OSError):
        pass
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, AttributeError, OSError):  # Pillow < 10.1 or no FreeType
        return ImageFont.load_default()


def _drawable(font: Any, text: str) -> str:
    """Text the font can encode: Pillow's bitmap fallback font only takes Latin-1."""
    if isinstance(font, ImageFont.FreeTypeFont):
        return text
    return text.encode("latin-1", errors="replace").decode("latin-1")


def _unit(size: tuple[int, int]) -> float:
    """Drawing unit in pixels: marks and labels scale with the screenshot."""
    return max(2.0, min(size) / 100.0)


def _as_action(action: Action | dict[str, Any] | Any) -> Action | None:
    """An Action from an Action or a traj.jsonl dict; None when it cannot be read."""
    if isinstance(action, Action):
        return action
    if not isinstance(action, dict):
        return None
    kind = action.get("kind")
    if not isinstance(kind, str):
        return None
    keys = action.get("keys") or []
    return Action(
        kind=kind,
        point=_as_point(action.get("point")),
        end_point=_as_point(action.get("end_point")),
        text=action.get("text") if isinstance(action.get("text"), str) else None,
        keys=[str(k) for k in keys] if isinstance(keys, (list, tuple)) else [str(keys)],
        direction=action.get("direction") if isinstance(action.get("direction"), str) else None,
    )


def _as_point(value: Any) -> tuple[float, float] | None:
    """(x, y) floats from a list/tuple, or None when missing or not two finite numbers."""
    try:
        x, y = (float(v) for v in value)
    except (TypeError, ValueError):
        return None
    if not (math.isfinite(x) and math.isfinite(y)):
        return None
    return x, y


def _clip(point: tuple[float, float], size: tuple[int, int]) -> tuple[tuple[float, float], bool]:
    """The point moved onto the image if it lies outside; and whether it had to move."""
    w, h = size
    x = min(max(point[0], 0.0), w - 1.0)
    y = min(max(point[1], 0.0), h - 1.0)
    return (x, y), (x, y) != (point[0], point[1])


def escape_label(text: str | None, limit: int = MAX_LABEL_CHARS) -> str:
    """One-line label text: newlines shown as ⏎, tabs as spaces, long text truncated with …."""
    text = (text or "").replace("\r\n", "\n").replace("\n", "⏎").replace("\t", " ")
    # Other control characters would draw as boxes or shift the layout.
    text = "".join(ch if ch.isprintable() else "?" for ch in text)
    if len(text) > limit:
        text = text[: max(1, limit - 1)] + "…"
    return text


class _Painter:
    """Draws on one RGBA overlay; keeps track of where labels and badges already are."""

    def __init__(self, image: Image.Image):
        self.size = image.size
        self.u = _unit(image.size)
        self.line = max(2, round(self.u * 0.8))
        # Floors keep labels readable in thumbnails of small (MiniWoB 160-320 px) screens.
        self.font = _font(max(13, round(self.u * 4.0)))
        self.small = _font(max(11, round(self.u * 3.2)))
        self.overlay = Image.new("RGBA", image.size, (0, 0, 0, 0))
        self.draw = ImageDraw.Draw(self.overlay)
        self.label_y = round(self.u * 1.5)  # next free row for top-left labels
        self.badge_y = round(self.u * 1.5)  # next free row for top-right badges

    # -- primitives -------------------------------------------------------------------------
    def text_size(self, text: str, font: Any) -> tuple[int, int]:
        left, top, right, bottom = self.draw.textbbox((0, 0), text, font=font)
        return right - left, bottom - top

    def fit(self, text: str, font: Any, width: float) -> str:
        """``text`` shortened with … until it is at most ``width`` pixels wide."""
        if self.text_size(text, font)[0] <= width:
            return text
        lo, hi = 0, len(text)  # longest prefix that fits, by bisection (labels can be long)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.text_size(text[:mid] + "…", font)[0] <= width:
                lo = mid
            else:
                hi = mid - 1
        return text[:lo] + "…"

    def box_text(self, xy: tuple[float, float], text: str, colour: tuple[int, int, int], *,
                 font: Any = None, anchor_right: bool = False) -> tuple[int, int]:
        """A filled label box with white text at xy (top-left, or top-right); returns its size."""
        font = font or self.font
        pad = max(2, round(self.u * 0.8))
        text = self.fit(_drawable(font, text), font, self.size[0] - 2 * pad)
        tw, th = self.text_size(text, font)
        w, h = tw + 2 * pad, th + 2 * pad
        x, y = xy
        if anchor_right:
            x -= w
        # Keep labels on the image even when the anchor point is near an edge.
        x = min(max(x, 0), max(0, self.size[0] - w))
        y = min(max(y, 0), max(0, self.size[1] - h))
        self.draw.rectangle([x, y, x + w, y + h], fill=colour + (215,), outline=(255, 255, 255, 255))
        left, top, _, _ = self.draw.textbbox((0, 0), text, font=font)
        self.draw.text((x + pad - left, y + pad - top), text, font=font, fill=(255, 255, 255, 255))
        return w, h

    def ring(self, centre: tuple[float, float], radius: float, colour: tuple[int, int, int]) -> None:
        x, y = centre
        self.draw.ellipse([x - radius, y - radius, x + radius, y + radius], outline=colour + (255,),
                          width=self.line)

    def dot(self, centre: tuple[float, float], radius: float, colour: tuple[int, int, int]) -> None:
        x, y = centre
        self.draw.ellipse([x - radius, y - radius, x + radius, y + radius], fill=colour + (255,))

    def arrow(self, start: tuple[float, float], end: tuple[float, float], colour: tuple[int, int, int]) -> None:
        """A line from start to end with a filled arrowhead at end."""
        fill = colour + (255,)
        self.draw.line([start, end], fill=fill, width=self.line + 1)
        dx, dy = end[0] - start[0], end[1] - start[1]
        length = math.hypot(dx, dy)
        if length < 1e-6:
            self.dot(end, self.u * 1.2, colour)
            return
        ux, uy = dx / length, dy / length
        head = min(self.u * 4.0, length * 0.6)
        back = (end[0] - ux * head, end[1] - uy * head)
        wing = head * 0.55
        self.draw.polygon([end, (back[0] - uy * wing, back[1] + ux * wing),
                           (back[0] + uy * wing, back[1] - ux * wing)], fill=fill)

    # -- what gets drawn ---------------------------------------------------------------------
    def label(self, text: str, colour: tuple[int, int, int]) -> None:
        """A label in the top-left stack (typed text, hotkeys)."""
        _, h = self.box_text((round(self.u * 1.5), self.label_y), text, colour)
        self.label_y += h + round(self.u * 0.6)

    def badge(self, text: str, colour: tuple[int, int, int]) -> None:
        """A badge in the top-right stack (wait, finished, call_user, format error)."""
        _, h = self.box_text((self.size[0] - round(self.u * 1.5), self.badge_y), text, colour,
                             anchor_right=True)
        self.badge_y += h + round(self.u * 0.6)

    def clipped_mark(self, point: tuple[float, float], colour: tuple[int, int, int]) -> None:
        """An X and an 'off-screen' note: the model pointed outside the screenshot."""
        x, y = point
        r = self.u * 2.0
        fill = colour + (255,)
        self.draw.line([(x - r, y - r), (x + r, y + r)], fill=fill, width=self.line)
        self.draw.line([(x - r, y + r), (x + r, y - r)], fill=fill, width=self.line)
        self.box_text((x + r, y + r), "off-screen", colour, font=self.small)

    def point(self, action: Action, index: int | None) -> None:
        """Click-like actions: ring + dot (double ring for double clicks, square for right)."""
        if action.point is None:
            self.badge(f"{action.kind} (no point)", CLICK_COLOUR)
            return
        (x, y), clipped = _clip(action.point, self.size)
        r = self.u * 4.5
        if action.kind == "right_single":
            colour = RIGHT_CLICK_COLOUR
            self.draw.rectangle([x - r, y - r, x + r, y + r], outline=colour + (255,), width=self.line)
            self.dot((x, y), self.u * 0.9, colour)
            self.box_text((x + r, y - r), "R", colour, font=self.small)
        elif action.kind == "left_double":
            colour = DOUBLE_CLICK_COLOUR
            self.ring((x, y), r, colour)
            self.ring((x, y), r * 1.6, colour)
            self.dot((x, y), self.u * 0.9, colour)
        else:
            colour = CLICK_COLOUR
            self.ring((x, y), r, colour)
            self.dot((x, y), self.u * 0.9, colour)
        if clipped:
            self.clipped_mark((x, y), colour)
        if index is not None:
            self.box_text((x - r, y + r), str(index), colour, font=self.small, anchor_right=True)

    def drag(self, action: Action, index: int | None) -> None:
        if action.point is None or action.end_point is None:
            self.badge("drag (no points)", DRAG_COLOUR)
            return
        start, start_clipped = _clip(action.point, self.size)
        end, end_clipped = _clip(action.end_point, self.size)
        self.ring(start, self.u * 2.0, DRAG_COLOUR)
        self.arrow(start, end, DRAG_COLOUR)
        for p, clipped in ((start, start_clipped), (end, end_clipped)):
            if clipped:
                self.clipped_mark(p, DRAG_COLOUR)
        if index is not None:
            self.box_text((start[0] - self.u * 2, start[1] + self.u * 2), str(index), DRAG_COLOUR,
                          font=self.small, anchor_right=True)

    def scroll(self, action: Action, index: int | None) -> None:
        w, h = self.size
        if action.point is None:
            centre, clipped = ((w - 1) / 2.0, (h - 1) / 2.0), False
        else:
            centre, clipped = _clip(action.point, self.size)
        vectors = {"up": (0, -1), "down": (0, 1), "left": (-1, 0), "right": (1, 0)}
        direction = (action.direction or "").lower()
        length = self.u * 15.0
        self.dot(centre, self.u * 1.2, SCROLL_COLOUR)
        if direction in vectors:
            vx, vy = vectors[direction]
            end, _ = _clip((centre[0] + vx * length, centre[1] + vy * length), self.size)
            self.arrow(centre, end, SCROLL_COLOUR)
        prefix = f"{index}. " if index is not None else ""
        self.box_text((centre[0] + self.u * 2, centre[1] + self.u * 2), f"{prefix}scroll {direction or '?'}",
                      SCROLL_COLOUR, font=self.small)
        if clipped:
            self.clipped_mark(centre, SCROLL_COLOUR)

    def thought(self, text: str) -> None:
        """The thought as a caption bar along the bottom edge."""
        caption = escape_label(text, limit=max(20, int(self.size[0] / (self.u * 1.9))))
        font = self.small
        caption = _drawable(font, caption)
        _, th = self.text_size(caption or " ", font)
        pad = max(2, round(self.u * 0.8))
        top = self.size[1] - th - 2 * pad
        self.draw.rectangle([0, top, self.size[0], self.size[1]], fill=(0, 0, 0, 170))
        left, ttop, _, _ = self.draw.textbbox((0, 0), caption, font=font)
        self.draw.text((pad - left, top + pad - ttop), caption, font=font, fill=(255, 255, 255, 255))


def draw_actions(image: Image.Image, actions: Sequence[Action | dict[str, Any]] | None, *,
                 thought: str | None = None, format_error: str | None = None) -> Image.Image:
    """A NEW RGB image: ``image`` with the actions (and optionally the thought) drawn on it.

    ``actions`` are :class:`Action` objects or traj.jsonl dicts, points in screenshot pixels.
    Click kinds draw a ring and dot (double ring for ``left_double``, blue square for
    ``right_single``), ``drag`` an arrow, ``scroll`` an arrow in its direction from its point
    (or the centre), ``type`` and ``hotkey`` a label top-left, ``wait``/``finished``/``call_user``
    a badge top-right. Points outside the image are clipped to its border and marked
    "off-screen". ``format_error`` (or no actions at all) draws a "format error" badge.
    Several actions are numbered in order. Unreadable actions are drawn as an "unknown" badge
    rather than raising: this is for looking at model output, which may be anything.
    """
    out = image.convert("RGB")  # always a copy: convert returns a new image even for RGB input
    painter = _Painter(out)
    parsed = [_as_action(a) for a in (actions or [])]
    numbered = len(parsed) > 1
    for i, action in enumerate(parsed, start=1):
        index = i if numbered else None
        prefix = f"{i}. " if numbered else ""
        if action is None:
            painter.badge(f"{prefix}unknown action", BADGE_COLOURS["wait"])
        elif action.kind in ("click", "left_double", "right_single"):
            painter.point(action, index)
        elif action.kind == "drag":
            painter.drag(action, index)
        elif action.kind == "scroll":
            painter.scroll(action, index)
        elif action.kind == "type":
            painter.label(f"{prefix}type: \"{escape_label(action.text)}\"", TYPE_COLOUR)
        elif action.kind in ("hotkey", "press"):
            keys = "+".join(escape_label(k, 20) for k in action.keys) or "?"
            painter.label(f"{prefix}{action.kind}: {keys}", HOTKEY_COLOUR)
        elif action.kind in BADGE_COLOURS:
            text = action.kind
            if action.kind == "finished" and action.text:
                text += f": {escape_label(action.text, 24)}"
            painter.badge(prefix + text, BADGE_COLOURS[action.kind])
        else:
            painter.badge(f"{prefix}{escape_label(action.kind, 20)}", BADGE_COLOURS["wait"])
    if format_error is not None or not parsed:
        painter.badge("format error", BADGE_COLOURS["format_error"])
        if format_error:
            painter.badge(escape_label(format_error, 32), BADGE_COLOURS["format_error"])
    if thought:
        painter.thought(thought)
    out.paste(painter.overlay, (0, 0), painter.overlay)
    return out


# =========================================================================== loading

@dataclass
class Frame:
    """One step of a trajectory as shown: the screen the action was taken on, action drawn."""

    step: int
    """Step number (1-based, as in traj.jsonl); the final frame has the last step + 1."""
    image: Image.Image
    """The screenshot with the action drawn (RGB)."""
    thought: str = ""
    """The response's Thought (the whole response when it has no Thought/Action parts)."""
    action_text: str = ""
    """The response's Action part, or ``format error: <parse_error>``; the result on the final frame."""
    reward: float | None = None
    """The environment's reward for this step (None on the final frame)."""
    done: bool = False
    truncated: bool = False
    replayed: bool = False
    """The trajectory came from the replay buffer."""
    format_error: bool = False
    final: bool = False
    """The last screenshot, after the last action, with the task score."""
    task_score: float | None = None
    """On the final frame: the task score (meta.json)."""
    screenshot_file: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    """The meta.json of the trajectory (task, instruction, ...), shared by its frames."""

    @property
    def title(self) -> str:
        """A short caption: step, reward and action."""
        if self.final:
            score = "?" if self.task_score is None else f"{self.task_score:g}"
            return f"end · score {score}"
        reward = "" if self.reward is None else f" · r={self.reward:g}"
        return f"step {self.step}{reward}"


def split_response(response: str | None) -> tuple[str, str]:
    """(thought, action text) of a UI-TARS response; thought falls back to the whole text."""
    text = response if isinstance(response, str) else ""
    label = _ACTION_LABEL.search(text)
    if label is None:
        pos = text.find("Action:")
        if pos < 0:
            return text.strip(), ""
        start, body = pos, pos + len("Action:")
    else:
        start, body = label.start(), label.end()
    prefix = text[:start]
    m = _THOUGHT_LABEL.search(prefix)
    thought = prefix[m.end():].strip() if m else prefix.strip()
    action = text[body:].strip()
    for token in ("<|im_end|>", "<|endoftext|>", "</s>"):
        action = action.removesuffix(token).rstrip()
    return (thought or text.strip()), action


def blank_like(size: tuple[int, int] | None) -> Image.Image:
    """A grey stand-in for a missing screenshot."""
    return Image.new("RGB", size or (320, 240), (200, 200, 200))


def _open_png(path: Path) -> Image.Image | None:
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (OSError, ValueError):
        return None


def float_or_none(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def load_frames(traj_dir: str | Path, *, replayed: bool | None = None, draw_thought: bool = False) -> list[Frame]:
    """One :class:`Frame` per step of a trajectory directory, plus a final result frame.

    Step k is drawn on ``step_{k-1}.png`` (the screen the model acted on). A format-failure step
    (no actions) gets a "format error" badge. ``replayed`` overrides meta.json's flag (the
    trainer's groups.json knows which members came from the replay buffer). Missing or
    unreadable screenshots become grey stand-ins. The trajectory store reads the records: a
    directory that is not a complete trajectory raises FileNotFoundError, a malformed record
    :class:`~arpo_lib.rollout.store.TrajectoryFormatError`.
    """
    stored = read_trajectory(traj_dir)
    traj = stored.trajectory
    meta = traj.summary()
    is_replayed = traj.replayed if replayed is None else bool(replayed)
    size: tuple[int, int] | None = None

    def screenshot(index: int) -> Image.Image:
        nonlocal size
        path = stored.screenshot(index)
        img = _open_png(path) if path is not None else None
        if img is None:
            return blank_like(size)
        size = img.size
        return img

    frames: list[Frame] = []
    for rec in traj.steps:
        base = screenshot(rec.step - 1)
        thought, action_text = split_response(rec.response)
        is_format_error = bool(rec.parse_error) or not rec.actions
        if is_format_error:
            action_text = f"format error: {rec.parse_error or 'no action'}"
        image = draw_actions(base, rec.actions, thought=thought if draw_thought else None,
                             format_error=str(rec.parse_error) if rec.parse_error else None)
        frames.append(Frame(
            step=rec.step, image=image, thought=thought, action_text=action_text,
            reward=float(rec.reward), done=rec.terminated or rec.truncated, truncated=rec.truncated,
            replayed=is_replayed, format_error=is_format_error, screenshot_file=layout.screenshot_name(rec.step - 1),
            extra=meta,
        ))

    last = max(stored.screenshots) if stored.screenshots else None
    final_image = screenshot(last) if last is not None else blank_like(size)
    last_step = frames[-1].step if frames else 0
    result = f"result: task score {traj.task_score:g}, reward {traj.reward:g}"
    if not traj.ok:
        result += f" ({traj.status}: {traj.error or ''})"
    frames.append(Frame(
        step=last_step + 1, image=final_image, thought="", action_text=result, reward=None,
        done=True, truncated=bool(frames and frames[-1].truncated), replayed=is_replayed, final=True,
        task_score=float(traj.task_score), screenshot_file=layout.screenshot_name(last) if last is not None else "",
        extra=meta,
    ))
    return frames


def list_groups(run_dir: str | Path) -> list[tuple[int, str]]:
    """(training step, task) of every group recorded under ``<run_dir>/rollouts``, in order."""
    found: list[tuple[int, str]] = []
    for step, path in RunDir(Path(run_dir)).all_groups():
        found.extend((step, str(g.get("task"))) for g in layout.read_groups(path))
    return found


def resolve_member_dir(member_dir: str | Path, run_dir: str | Path) -> Path:
    """Where a groups.json member directory is: absolute as is; relative against the cwd,
    the run directory or one of its parents (runs record paths relative to where they ran)."""
    path = Path(member_dir)
    if path.is_absolute():
        return path
    run_dir = Path(run_dir).resolve()
    for base in (Path.cwd(), run_dir, *run_dir.parents):
        if (base / path).is_dir():
            return base / path
    return path


def load_group(run_dir: str | Path, step: int, task: str) -> list[tuple[list[Frame], dict[str, Any]]]:
    """The frames and groups.json entry of every member of one group (training step, task).

    A member whose directory is missing or unreadable gets a single grey frame saying so, so one
    lost trajectory does not hide the rest of its group.
    """
    run_dir = Path(run_dir)
    path = RunDir(run_dir).groups(int(step))
    groups = layout.read_groups(path)
    if not groups:
        raise FileNotFoundError(f"no readable groups.json at {path}")
    group = next((g for g in groups if g.get("task") == task), None)
    if group is None:
        tasks = [g.get("task") for g in groups]
        raise KeyError(f"no group for task {task!r} at step {step}; tasks there: {tasks}")
    out = []
    for member in group.get("members", []):
        directory = resolve_member_dir(member.get("dir") or "", run_dir)
        try:
            frames = load_frames(directory, replayed=bool(member.get("replayed", False)))
        except (FileNotFoundError, TrajectoryFormatError) as exc:
            what = f"missing: {directory}" if isinstance(exc, FileNotFoundError) else f"unreadable: {exc}"
            frames = [Frame(step=0, image=blank_like(None), action_text=what, final=True,
                            replayed=bool(member.get("replayed", False)))]
        out.append((frames, member))
    return out


# =========================================================================== static figures

def thumbnail(image: Image.Image, width: int) -> Image.Image:
    """A copy no wider than ``width`` (never upscaled), aspect ratio kept."""
    if image.width <= width:
        return image.copy()
    height = max(1, round(image.height * width / image.width))
    return image.resize((width, height), Image.Resampling.LANCZOS)
