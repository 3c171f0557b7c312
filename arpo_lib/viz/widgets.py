"""Notebook widgets over the pure renderers of `arpo_lib.viz.draw`: a step viewer for one
trajectory and a group browser for a run. Every view also displays its static figure, so a
saved or papermill-executed notebook, or one opened where widgets cannot render (GitHub's
notebook view, nbviewer), still shows the trajectory.

On Colab, ipywidgets render only through Colab's custom widget manager: `show_trajectory` and
`show_group` turn it on (once) when they run under Colab. Without ipywidgets installed they show
the static figure alone and say why.
"""
from __future__ import annotations

import html
import io
import sys
from pathlib import Path
from typing import Any, Sequence

from PIL import Image

from arpo_lib.viz.draw import (REPLAYED_COLOUR, WIDGET_MAX_WIDTH, Frame, blank_like, float_or_none, list_groups,
                               load_frames, load_group, thumbnail)
from arpo_lib.viz.filmstrips import figure_png, filmstrip, group_figure


def image_png(image: Image.Image, max_width: int = WIDGET_MAX_WIDTH) -> bytes:
    """PNG bytes of an image downscaled to at most ``max_width`` pixels wide."""
    buf = io.BytesIO()
    thumbnail(image, max_width).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def frame_html(frame: Frame) -> str:
    """The text pane of the step viewer: step, reward, flags, thought and action (escaped)."""
    flags = ["replayed" if frame.replayed else "fresh"]
    if frame.done:
        flags.append("done")
    if frame.truncated:
        flags.append("truncated")
    if frame.format_error:
        flags.append("<b style='color:#b00000'>format error</b>")
    reward = "" if frame.reward is None else f" &middot; reward <b>{frame.reward:g}</b>"
    head = f"<b>{html.escape(frame.title.split(' · ')[0])}</b>{reward} &middot; {' &middot; '.join(flags)}"
    thought = html.escape(frame.thought) if frame.thought else "<i>(none)</i>"
    action = html.escape(frame.action_text) or "<i>(none)</i>"
    return (f"<div style='font-family:sans-serif;font-size:13px;max-width:480px'>{head}"
            f"<div><b>Thought:</b> <span style='white-space:pre-wrap'>{thought}</span></div>"
            f"<div><b>Action:</b> <code style='white-space:pre-wrap'>{action}</code></div></div>")


class StepViewer:
    """Step through one trajectory: Play + slider, the drawn frame, and its text.

    ``.widget`` is the ipywidgets box to display. Frames are drawn once on load (the pure
    :func:`load_frames`); moving the slider only swaps PNG bytes and HTML.
    """

    def __init__(self, traj_dir_or_frames: str | Path | Sequence[Frame], *, interval_ms: int = 800):
        import ipywidgets as widgets

        if isinstance(traj_dir_or_frames, (str, Path)):
            self.frames = load_frames(traj_dir_or_frames)
        else:
            self.frames = list(traj_dir_or_frames)
        if not self.frames:
            self.frames = [Frame(step=0, image=blank_like(None), action_text="no frames", final=True)]
        last = len(self.frames) - 1
        self._png: dict[int, bytes] = {}
        self.play = widgets.Play(value=0, min=0, max=last, step=1, interval=interval_ms)
        self.slider = widgets.IntSlider(value=0, min=0, max=last, step=1, description="frame",
                                        continuous_update=True)
        # jslink runs in the browser, so Play drives the slider even with a busy kernel.
        self.link = widgets.jslink((self.play, "value"), (self.slider, "value"))
        self.image = widgets.Image(format="png", layout=widgets.Layout(max_width=f"{WIDGET_MAX_WIDTH}px"))
        self.html = widgets.HTML()
        self.slider.observe(self._on_change, names="value")
        self.widget = widgets.VBox([widgets.HBox([self.play, self.slider]), self.image, self.html])
        self.show(0)

    def _on_change(self, change: dict[str, Any]) -> None:
        self.show(int(change["new"]))

    def show(self, index: int) -> None:
        """Show frame ``index`` (clamped into range); the slider follows."""
        index = min(max(int(index), 0), len(self.frames) - 1)
        if index not in self._png:
            self._png[index] = image_png(self.frames[index].image)
        self.image.value = self._png[index]
        self.html.value = frame_html(self.frames[index])
        if self.slider.value != index:
            self.slider.value = index


class GroupView:
    """Browse the groups of a run: pick (step, task), see all G rollouts, open one.

    Each rollout column shows a thumbnail of its last action frame with reward, advantage and
    replayed/fresh; its "open" button (or :meth:`select`) shows it in an embedded
    :class:`StepViewer` below.
    """

    def __init__(self, run_dir: str | Path, step: int | None = None, task: str | None = None, *,
                 thumb_width: int = 200):
        import ipywidgets as widgets

        self._widgets = widgets
        self.run_dir = Path(run_dir)
        self.thumb_width = thumb_width
        self.groups = list_groups(self.run_dir)
        options = [(f"step {s} · {t}", (s, t)) for s, t in self.groups]
        initial = self._initial(step, task)
        self.dropdown = widgets.Dropdown(options=options, value=initial, description="group",
                                         layout=widgets.Layout(width="460px"))
        self.grid = widgets.HBox()
        self.viewer_box = widgets.VBox()
        self.members: list[tuple[list[Frame], dict[str, Any]]] = []
        self.buttons: list[Any] = []
        self.viewer: StepViewer | None = None
        self.dropdown.observe(self._on_group, names="value")
        self.widget = widgets.VBox([self.dropdown, self.grid, self.viewer_box])
        if initial is not None:
            self.load(*initial)
        else:
            self.grid.children = [widgets.HTML(f"<i>no groups.json under {html.escape(str(self.run_dir))}</i>")]

    def _initial(self, step: int | None, task: str | None) -> tuple[int, str] | None:
        """The requested group, or the first one matching what was given."""
        for s, t in self.groups:
            if (step is None or s == step) and (task is None or t == task):
                return s, t
        if step is not None or task is not None:
            raise KeyError(f"no group with step={step}, task={task!r} in {self.run_dir}")
        return None

    def _on_group(self, change: dict[str, Any]) -> None:
        if change["new"] is not None:
            self.load(*change["new"])

    def load(self, step: int, task: str) -> None:
        """Show one group's members and open its first rollout."""
        widgets = self._widgets
        self.members = load_group(self.run_dir, step, task)
        columns, self.buttons = [], []
        for i, (frames, member) in enumerate(self.members):
            acted = [f for f in frames if not f.final] or frames
            replayed = bool(member.get("replayed", False))
            colour = REPLAYED_COLOUR if replayed else "#888"
            image = widgets.Image(value=image_png(acted[-1].image, self.thumb_width), format="png",
                                  layout=widgets.Layout(border=f"3px solid {colour}"))
            text = widgets.HTML(
                f"<div style='font-family:sans-serif;font-size:12px'><b>#{i}</b> "
                f"reward <b>{float_or_none(member.get('reward')) or 0:.2f}</b><br>"
                f"adv {float_or_none(member.get('advantage')) or 0:+.2f} &middot; "
                f"<span style='color:{colour}'>{'replayed' if replayed else 'fresh'}</span><br>"
                f"{member.get('num_steps', len(acted))} steps"
                f"{'' if member.get('format_ok', True) else ' &middot; format error'}</div>")
            button = widgets.Button(description=f"open #{i}", layout=widgets.Layout(width="auto"))
            button.on_click(lambda _b, i=i: self.select(i))
            self.buttons.append(button)
            columns.append(widgets.VBox([image, text, button]))
        self.grid.children = columns
        if self.members:
            self.select(0)
        else:
            self.viewer_box.children = []

    def select(self, index: int) -> None:
        """Open member ``index`` of the current group in the embedded step viewer."""
        frames, member = self.members[index]
        self.viewer = StepViewer(frames)
        title = self._widgets.HTML(f"<b>rollout #{index}</b> &middot; <code>{html.escape(str(member.get('dir')))}</code>")
        self.viewer_box.children = [title, self.viewer.widget]


# -- notebook helpers ----------------------------------------------------------------------

def _display_figure(fig: Any) -> None:
    """Display a Figure as a PNG (works with any backend, stored in the saved notebook)."""
    from IPython.display import Image as PNG, display

    display(PNG(data=figure_png(fig)))
    # No plt.close needed: these Figures are built without pyplot, so no backend holds them
    # and the inline backend cannot show them a second time at the end of the cell.


_colab_widgets_enabled = False


def enable_colab_widgets() -> bool:
    """Under Colab, turn on its custom widget manager (ipywidgets 8 render only through it) once;
    True when running under Colab."""
    global _colab_widgets_enabled
    if "google.colab" not in sys.modules:
        return False
    if not _colab_widgets_enabled:
        from google.colab import output

        output.enable_custom_widget_manager()
        _colab_widgets_enabled = True
    return True


def _widgets_available() -> bool:
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        print("ipywidgets is not installed (pip install ipywidgets): the static figure only")
        return False
    enable_colab_widgets()
    return True


def show_trajectory(traj_dir: str | Path, *, max_frames: int = 8) -> None:
    """Display a StepViewer AND its static filmstrip (the figure survives a saved notebook)."""
    from IPython.display import display

    frames = load_frames(traj_dir)
    if _widgets_available():
        display(StepViewer(frames).widget)
    _display_figure(filmstrip(frames, max_frames=max_frames))


def show_group(run_dir: str | Path, step: int | None = None, task: str | None = None) -> None:
    """Display a GroupView AND the static group figure of the selected group (the first one, or
    (`step`, `task`))."""
    from IPython.display import display

    if _widgets_available():
        view = GroupView(run_dir, step, task)
        display(view.widget)
        chosen = view.dropdown.value
    else:
        groups = list_groups(run_dir)
        chosen = next(((s, t) for s, t in groups if (step is None or s == step) and (task is None or t == task)),
                      None)
    if chosen is not None:
        _display_figure(group_figure(run_dir, *chosen))
