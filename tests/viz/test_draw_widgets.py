"""Tests for arpo_lib.viz: pixels of the drawn actions, frame loading, figures and widgets.

Every trajectory here is made of hand-written step records and written by the trajectory store's
writer (step_N.png, traj.jsonl, meta.json, result.txt), so the tests need no browser, model or GPU.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest
from PIL import Image

from arpo_lib.viz import draw, filmstrips, widgets
from arpo_lib.actions import Action
from arpo_lib.rollout import store
from arpo_lib.types import StepRecord, Trajectory

W, H = 320, 240
BACKGROUND = (250, 250, 250)


def _blank(size: tuple[int, int] = (W, H)) -> Image.Image:
    return Image.new("RGB", size, BACKGROUND)


def _mask(image: Image.Image, colour: tuple[int, int, int], tol: int = 10) -> np.ndarray:
    """Boolean (H, W) mask of pixels within ``tol`` of ``colour``."""
    arr = np.asarray(image.convert("RGB")).astype(int)
    return (np.abs(arr - np.array(colour)) <= tol).all(axis=-1)


def _changed(a: Image.Image, b: Image.Image) -> np.ndarray:
    return (np.asarray(a.convert("RGB")) != np.asarray(b.convert("RGB"))).any(axis=-1)


# --------------------------------------------------------------------------- test data

STEPS = [
    ("Thought: open the menu\nAction: click(start_box='(100,80)')",
     [{"kind": "click", "point": [100.0, 80.0], "end_point": None, "text": None, "keys": [], "direction": None}]),
    ("Thought: move the slider\nAction: drag(start_box='(40,200)', end_box='(280,200)')",
     [{"kind": "drag", "point": [40.0, 200.0], "end_point": [280.0, 200.0], "text": None, "keys": [],
       "direction": None}]),
    ("Thought: write two lines\nAction: type(content='hello\\nworld')",
     [{"kind": "type", "point": None, "end_point": None, "text": "hello\nworld", "keys": [], "direction": None}]),
    ("Thought: copy\nAction: hotkey(key='ctrl c')",
     [{"kind": "hotkey", "point": None, "end_point": None, "text": None, "keys": ["ctrl", "c"], "direction": None}]),
    ("Thought: see more\nAction: scroll(start_box='(160,120)', direction='down')",
     [{"kind": "scroll", "point": [160.0, 120.0], "end_point": None, "text": None, "keys": [],
       "direction": "down"}]),
    ("I think I am done, somehow", []),  # format failure: no Action, ends the episode
]


def write_trajectory(directory: Path, *, steps: list = STEPS, replayed: bool = False,
                     task_score: float = 0.0, shade: int = 0) -> Path:
    """A trajectory directory of `steps`. Screenshot k is tinted so frames can be told apart."""
    # One screenshot after reset plus one per step that ran (the format failure adds none).
    executed = sum(1 for _, actions in steps if actions)
    shots = [Image.new("RGB", (W, H), (200 - 10 * k, 220, 200 + shade)) for k in range(executed + 1)]
    traj = Trajectory(task="miniwob/test-task", seed=1, sample=0, instruction="Do the thing.", task_score=task_score,
                      format_ok=all(a for _, a in steps), reward=task_score, replayed=replayed)
    for i, (response, actions) in enumerate(steps, start=1):
        failed = not actions
        last = i == len(steps)
        traj.steps.append(StepRecord(step=i, response=response, actions=actions,
                                     parse_error="no 'Action:' found" if failed else None,
                                     reward=task_score if last and not failed else 0.0, terminated=last,
                                     truncated=False, seconds=0.0))
    store.write_trajectory(traj, directory, shots)
    return directory


@pytest.fixture
def traj_dir(tmp_path: Path) -> Path:
    return write_trajectory(tmp_path / "traj")


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A run with one group of 4 rollouts at step 3: member dirs relative to the cwd (the way the
    trainer records them), one absolute, one replayed from a demo."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "r"
    members = []
    for i in range(4):
        replayed = i == 0
        rel = Path("runs/r/demos/t/0") if replayed else Path(f"runs/r/rollouts/step_000003/t/{i}")
        directory = write_trajectory(tmp_path / rel, steps=STEPS[:2] if i % 2 else STEPS, replayed=False,
                                     task_score=1.0 if replayed else 0.0, shade=10 * i)
        members.append({"dir": str(directory if i == 3 else rel), "task_score": 1.0 if replayed else 0.0,
                        "reward": 1.0 if replayed else -0.5, "advantage": 1.5 if replayed else -0.5,
                        "replayed": replayed, "format_ok": True, "num_steps": 2})
    groups = [{"task": "miniwob/test-task", "all_failed": True, "injected": True, "members": members},
              {"task": "miniwob/other", "all_failed": False, "injected": False, "members": members[1:]}]
    path = run / "rollouts" / "step_000003" / "groups.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(groups))
    return run


# --------------------------------------------------------------------------- drawing

def test_click_ring_around_point_and_input_unchanged():
    image = _blank()
    before = image.copy()
    out = draw.draw_actions(image, [Action("click", point=(100.0, 80.0))])
    assert out is not image and out.mode == "RGB" and out.size == image.size
    assert np.array_equal(np.asarray(image), np.asarray(before))
    ys, xs = np.nonzero(_mask(out, draw.CLICK_COLOUR))
    assert len(xs) > 20
    # Everything red lies within a few ring radii of the point; the dot sits on it.
    assert np.hypot(xs - 100, ys - 80).max() < 30
    assert _mask(out, draw.CLICK_COLOUR)[80, 100]


def test_click_variants_differ():
    point = (160.0, 120.0)
    double = draw.draw_actions(_blank(), [Action("left_double", point=point)])
    right = draw.draw_actions(_blank(), [Action("right_single", point=point)])
    assert _mask(double, draw.DOUBLE_CLICK_COLOUR).sum() > _mask(
        draw.draw_actions(_blank(), [Action("click", point=point)]), draw.CLICK_COLOUR).sum()
    assert _mask(right, draw.RIGHT_CLICK_COLOUR).sum() > 20
    assert _mask(right, draw.CLICK_COLOUR).sum() == 0


def test_drag_draws_along_segment():
    out = draw.draw_actions(_blank(), [{"kind": "drag", "point": [40, 200], "end_point": [280, 200]}])
    mask = _mask(out, draw.DRAG_COLOUR)
    for x in range(60, 261, 20):
        assert mask[195:206, x].any(), f"no drag pixel at x={x}"
    assert not mask[:150].any()  # nothing far from the segment


def test_scroll_arrow_points_in_direction():
    out = draw.draw_actions(_blank(), [Action("scroll", point=(160.0, 60.0), direction="down")])
    ys, _ = np.nonzero(_mask(out, draw.SCROLL_COLOUR))
    assert ys.max() > 80  # the arrow goes down from the point
    # No point: the arrow starts at the centre.
    centred = draw.draw_actions(_blank(), [Action("scroll", direction="up")])
    assert _mask(centred, draw.SCROLL_COLOUR)[H // 2 - 3:H // 2 + 3, W // 2 - 3:W // 2 + 3].any()


@pytest.mark.parametrize("action", [
    Action("click", point=(10.0, 10.0)), Action("left_double", point=(10.0, 10.0)),
    Action("right_single", point=(10.0, 10.0)), Action("drag", point=(1.0, 1.0), end_point=(50.0, 50.0)),
    Action("scroll", point=(5.0, 5.0), direction="left"), Action("type", text="hi"),
    Action("hotkey", keys=["ctrl", "c"]), Action("wait"), Action("finished", text="done"),
    Action("call_user"),
])
def test_every_kind_draws_something(action):
    image = _blank()
    assert _changed(draw.draw_actions(image, [action]), image).sum() > 20


def test_type_and_hotkey_labels():
    assert draw.escape_label("a\nb") == "a⏎b"
    long = draw.escape_label("x" * 500)
    assert len(long) == draw.MAX_LABEL_CHARS and long.endswith("…")
    out = draw.draw_actions(_blank(), [Action("type", text="hello\nworld")])
    assert _mask(out, draw.TYPE_COLOUR, tol=40).sum() > 50
    out = draw.draw_actions(_blank(), [Action("hotkey", keys=["ctrl", "c"])])
    assert _mask(out, draw.HOTKEY_COLOUR, tol=40).sum() > 50


def test_badges_in_top_right_corner():
    out = draw.draw_actions(_blank(), [Action("finished")])
    changed = _changed(out, _blank())
    ys, xs = np.nonzero(changed)
    assert xs.min() > W // 3 and ys.max() < H // 3


def test_offscreen_point_is_clipped_and_marked():
    image = _blank()
    out = draw.draw_actions(image, [Action("click", point=(1e9, 120.0))])
    mask = _mask(out, draw.CLICK_COLOUR)
    assert mask[:, W - 20:].any()
    # Marked: more is drawn than an in-image click (the X and the "off-screen" note).
    inside = draw.draw_actions(image, [Action("click", point=(W - 1.0, 120.0))])
    assert _changed(out, image).sum() > _changed(inside, image).sum()


@pytest.mark.parametrize("actions", [
    [{"kind": "click", "point": None}], [{"kind": "click", "point": ["nan", 3]}],
    [{"kind": "type", "text": ""}], [{"kind": "type", "text": None}],
    [{"kind": "drag", "point": [1, 2]}], [{"kind": "scroll", "direction": "sideways"}],
    [{"kind": "hotkey", "keys": []}], [{"kind": "type", "text": "日本語 ✓ émoji 🙂\x00\t"}],
    [{"kind": "click", "point": [-1e300, 1e300]}], [{"kind": "teleport"}], [{"no": "kind"}], [None], [],
    [{"kind": "click", "point": [5, 5]}, {"kind": "type", "text": "x"}, {"kind": "finished"}],
])
def test_weird_inputs_do_not_raise(actions):
    out = draw.draw_actions(_blank(), actions, thought="Thought with\nnewline and ünïcode")
    assert out.size == (W, H)


def test_tiny_and_large_images():
    for size in ((8, 8), (1920, 1080)):
        out = draw.draw_actions(_blank(size), [Action("click", point=(4.0, 4.0)), Action("type", text="t")])
        assert out.size == size
    big = draw.draw_actions(_blank((1920, 1080)), [Action("click", point=(960.0, 540.0))])
    small = draw.draw_actions(_blank(), [Action("click", point=(160.0, 120.0))])
    # Marks scale with the image.
    assert _mask(big, draw.CLICK_COLOUR).sum() > 4 * _mask(small, draw.CLICK_COLOUR).sum()


def test_format_error_badge():
    out = draw.draw_actions(_blank(), [])
    assert _mask(out, draw.BADGE_COLOURS["format_error"], tol=40).sum() > 30


# --------------------------------------------------------------------------- loading

def test_split_response():
    assert draw.split_response("Thought: a b\nAction: click(start_box='(1,2)')<|im_end|>") == (
        "a b", "click(start_box='(1,2)')")
    assert draw.split_response("just text") == ("just text", "")
    assert draw.split_response(None) == ("", "")


def test_load_frames(traj_dir: Path):
    frames = draw.load_frames(traj_dir)
    assert len(frames) == len(STEPS) + 1
    assert [f.step for f in frames] == [1, 2, 3, 4, 5, 6, 7]
    first = frames[0]
    assert first.thought == "open the menu" and first.action_text == "click(start_box='(100,80)')"
    assert first.screenshot_file == "step_0.png" and not first.replayed
    # The action is drawn on step_0.png, the screen the model acted on.
    raw = Image.open(traj_dir / "step_0.png").convert("RGB")
    assert _mask(first.image, draw.CLICK_COLOUR)[80, 100] and not _mask(raw, draw.CLICK_COLOUR).any()
    assert frames[1].image.getpixel((5, H - 5)) == Image.open(traj_dir / "step_1.png").getpixel((5, H - 5))
    bad = frames[5]
    assert bad.format_error and bad.done and "format error" in bad.action_text
    assert bad.thought == "I think I am done, somehow"
    assert _mask(bad.image, draw.BADGE_COLOURS["format_error"], tol=40).any()
    final = frames[-1]
    assert final.final and final.task_score == 0.0 and "task score 0" in final.action_text
    assert final.screenshot_file == "step_5.png"


def test_load_frames_replayed_flag_and_missing(tmp_path: Path):
    directory = write_trajectory(tmp_path / "t", replayed=True)
    assert all(f.replayed for f in draw.load_frames(directory))
    assert not any(f.replayed for f in draw.load_frames(directory, replayed=False))
    (directory / "step_2.png").unlink()  # a lost screenshot becomes a grey stand-in
    assert len(draw.load_frames(directory)) == len(STEPS) + 1
    with pytest.raises(FileNotFoundError):
        draw.load_frames(tmp_path / "nowhere")
    (directory / "traj.jsonl").write_text("not a record\n")  # the store's reader refuses it, saying where
    with pytest.raises(store.TrajectoryFormatError, match="traj.jsonl:1"):
        draw.load_frames(directory)


def test_list_and_load_group(run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    assert draw.list_groups(run_dir) == [(3, "miniwob/test-task"), (3, "miniwob/other")]
    # Relative member dirs resolve from elsewhere too (against the run dir's parents).
    monkeypatch.chdir(run_dir)
    members = draw.load_group(run_dir, 3, "miniwob/test-task")
    assert len(members) == 4
    assert [m["replayed"] for _, m in members] == [True, False, False, False]
    assert all(f.replayed for f in members[0][0]) and not members[1][0][0].replayed
    assert [len(frames) for frames, _ in members] == [7, 3, 7, 3]
    with pytest.raises(KeyError):
        draw.load_group(run_dir, 3, "nope")
    # A member the store's reader refuses shows why, the rest of the group still shows.
    (draw.resolve_member_dir(members[1][1]["dir"], run_dir) / "meta.json").write_text("{}")
    members = draw.load_group(run_dir, 3, "miniwob/test-task")
    assert [len(frames) for frames, _ in members] == [7, 1, 7, 3]
    assert members[1][0][0].action_text.startswith("unreadable:") and "lacks 'task'" in members[1][0][0].action_text


# --------------------------------------------------------------------------- figures

def test_filmstrip(traj_dir: Path):
    fig = filmstrips.filmstrip(traj_dir, max_frames=4, thumb_width=120)
    axes = [ax for ax in fig.axes if ax.images]
    assert len(axes) == 4
    titles = [ax.get_title(loc="left") for ax in axes]
    assert titles[0].startswith("step 1") and titles[-1].startswith("end")
    assert all(ax.images[0].get_array().shape[1] <= 120 for ax in axes)
    png = filmstrips.figure_png(fig)
    assert png[:4] == b"\x89PNG"


def test_group_figure(run_dir: Path):
    fig = filmstrips.group_figure(run_dir, 3, "miniwob/test-task", thumb_width=100)
    axes = [ax for ax in fig.axes if ax.images]
    assert len(axes) == 4
    titles = [ax.get_title(loc="left") for ax in axes]
    assert "+1.50" in titles[0] and "replayed" in titles[0]
    assert all("fresh" in t and "-0.50" in t for t in titles[1:])
    assert all(ax.images[0].get_array().shape[1] <= 100 for ax in axes)
    # The replayed column has a coloured border.
    edge = axes[0].spines["top"].get_edgecolor()
    assert matplotlib.colors.to_hex(edge) == draw.REPLAYED_COLOUR
    assert matplotlib.colors.to_hex(axes[1].spines["top"].get_edgecolor()) != draw.REPLAYED_COLOUR
    two = filmstrips.group_figure(run_dir, 3, "miniwob/test-task", thumb_width=80, frames_per_member=2)
    assert len([ax for ax in two.axes if ax.images]) == 8


# --------------------------------------------------------------------------- widgets

def test_step_viewer_slider_updates_image_and_html(traj_dir: Path):
    viewer = widgets.StepViewer(traj_dir)
    assert viewer.slider.max == len(STEPS) and viewer.play.max == len(STEPS)
    first_png, first_html = viewer.image.value, viewer.html.value
    assert first_png[:4] == b"\x89PNG" and "open the menu" in first_html and "fresh" in first_html
    viewer.slider.value = 5
    assert viewer.image.value != first_png
    assert "format error" in viewer.html.value and "done" in viewer.html.value
    viewer.slider.value = 2
    assert "hello" in viewer.html.value
    width = Image.open(__import__("io").BytesIO(viewer.image.value)).width
    assert width <= draw.WIDGET_MAX_WIDTH
    assert viewer.widget is not None


def test_step_viewer_escapes_html(tmp_path: Path):
    steps = [("Thought: <script>x</script>\nAction: wait()", [{"kind": "wait"}])]
    viewer = widgets.StepViewer(write_trajectory(tmp_path / "t", steps=steps))
    assert "<script>" not in viewer.html.value and "&lt;script&gt;" in viewer.html.value


def test_group_view_select_and_switch(run_dir: Path):
    view = widgets.GroupView(run_dir)
    assert view.dropdown.value == (3, "miniwob/test-task")
    assert len(view.grid.children) == 4
    assert "replayed" in view.grid.children[0].children[1].value
    first = view.viewer
    view.buttons[2].click()
    assert view.viewer is not first and view.viewer_box.children[1] is view.viewer.widget
    view.dropdown.value = (3, "miniwob/other")
    assert len(view.grid.children) == 3
    with pytest.raises(KeyError):
        widgets.GroupView(run_dir, step=9)


def test_group_view_empty_run(tmp_path: Path):
    view = widgets.GroupView(tmp_path)
    assert view.dropdown.value is None and "no groups" in view.grid.children[0].value


def test_show_helpers_display_widget_and_figure(traj_dir: Path, run_dir: Path, monkeypatch: pytest.MonkeyPatch):
    import IPython.display

    shown: list = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, *a, **k: shown.append(obj))
    widgets.show_trajectory(traj_dir)
    widgets.show_group(run_dir)
    kinds = [type(o).__name__ for o in shown]
    assert kinds == ["VBox", "Image", "VBox", "Image"]
    assert shown[1].data[:4] == b"\x89PNG"


def test_under_colab_the_custom_widget_manager_is_turned_on_once(traj_dir: Path, run_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch):
    import types

    import IPython.display

    calls: list = []
    shown: list = []
    output = types.SimpleNamespace(enable_custom_widget_manager=lambda: calls.append(len(shown)))
    colab = types.ModuleType("google.colab")
    colab.output = output
    monkeypatch.setitem(sys.modules, "google", types.ModuleType("google"))
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    monkeypatch.setitem(sys.modules, "google.colab.output", output)
    monkeypatch.setattr(widgets, "_colab_widgets_enabled", False)
    monkeypatch.setattr(IPython.display, "display", lambda obj, *a, **k: shown.append(obj))
    widgets.show_trajectory(traj_dir)
    widgets.show_group(run_dir)
    assert calls == [0]  # before the first widget, and only once
    assert [type(o).__name__ for o in shown] == ["VBox", "Image", "VBox", "Image"]


def test_outside_colab_nothing_is_turned_on_and_without_ipywidgets_the_figures_remain(
        traj_dir: Path, run_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    import IPython.display

    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    assert widgets.enable_colab_widgets() is False
    shown: list = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, *a, **k: shown.append(obj))
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # importing it fails
    widgets.show_trajectory(traj_dir)
    widgets.show_group(run_dir)
    assert [type(o).__name__ for o in shown] == ["Image", "Image"]
    assert "ipywidgets is not installed" in capsys.readouterr().out
