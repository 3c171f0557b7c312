"""Static figures of trajectories, the views a saved notebook keeps: a trajectory's filmstrip
(`filmstrip`), a group's rollouts side by side (`group_figure`), and a figure as PNG bytes. The
frames they show are `draw`'s (load_frames, load_group, draw_actions)."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Sequence

from arpo_lib.viz.draw import (REPLAYED_COLOUR, Frame, blank_like, escape_label, float_or_none, load_frames, load_group,
                               thumbnail)


def _pick(frames: Sequence[Frame], max_frames: int) -> list[Frame]:
    """At most max_frames frames, evenly spread, always keeping the first and the last."""
    n = len(frames)
    if n <= max_frames:
        return list(frames)
    if max_frames <= 1:
        return [frames[-1]]
    idx = sorted({round(i * (n - 1) / (max_frames - 1)) for i in range(max_frames)})
    return [frames[i] for i in idx]


def _wrap(text: str, width: int, lines: int) -> str:
    """One-line-escaped text cut into at most ``lines`` lines of ``width`` characters."""
    text = escape_label(text, limit=width * lines)
    return "\n".join(text[i:i + width] for i in range(0, len(text), width)) if text else ""


def filmstrip(traj_dir_or_frames: str | Path | Sequence[Frame], *, max_frames: int = 8,
              thumb_width: int = 240, title: str | None = None) -> Any:
    """A matplotlib Figure: the trajectory's frames left to right, actions drawn.

    Each panel is titled with the step, reward and action text; thumbnails are downscaled to
    ``thumb_width`` pixels and the figure is sized so one thumbnail pixel is one figure pixel
    at 100 dpi (saved notebooks stay small). Long trajectories show ``max_frames`` frames
    spread evenly, first and last included. The default title is the task and instruction.
    """
    from arpo_lib.viz.figures import ReportFigure

    if isinstance(traj_dir_or_frames, (str, Path)):
        frames = load_frames(traj_dir_or_frames)
    else:
        frames = list(traj_dir_or_frames)
    shown = _pick(frames, max(1, max_frames))
    if title is None and frames and frames[0].extra:
        meta = frames[0].extra
        title = f"{meta.get('task', '')}: {escape_label(meta.get('instruction', ''), 90)}"
    thumbs = [thumbnail(f.image, thumb_width) for f in shown] or [blank_like((thumb_width, thumb_width))]
    chars = max(12, thumb_width // 7)
    panel_w = thumb_width / 100
    panel_h = max(t.height for t in thumbs) / 100
    fig = ReportFigure(figsize=(panel_w * len(thumbs) + 0.2, panel_h + 0.45 + (0.25 if title else 0)), dpi=100,
                 layout="constrained")
    axes = fig.subplots(1, len(thumbs), squeeze=False)[0]
    for ax, frame, thumb in zip(axes, shown or [None], thumbs):
        ax.imshow(thumb)
        ax.set_xticks([])
        ax.set_yticks([])
        if frame is None:
            ax.set_title("no frames", fontsize=8)
            continue
        colour = "#b00000" if frame.format_error else "black"
        ax.set_title(f"{frame.title}\n{_wrap(frame.action_text, chars, 2)}", fontsize=7, color=colour,
                     loc="left")
    if title:
        fig.suptitle(title, fontsize=9, x=0.01, ha="left")
    return fig


def group_figure(run_dir: str | Path, step: int, task: str, *, thumb_width: int = 200,
                 frames_per_member: int = 1) -> Any:
    """A matplotlib Figure: one column per rollout of a group, the last frames of each.

    Columns are titled with reward, advantage (2 decimals) and "replayed"/"fresh"; replayed
    members get a red border. ``frames_per_member`` > 1 adds the frames before the last,
    top to bottom. The last frame shown is the last action (with its drawing), since the
    final screen alone does not say what the model did; a format failure shows its badge.
    """
    from arpo_lib.viz.figures import ReportFigure

    members = load_group(run_dir, step, task)
    rows = max(1, frames_per_member)
    cols = max(1, len(members))
    columns: list[list[Frame]] = []
    for frames, _ in members:
        acted = [f for f in frames if not f.final] or frames
        columns.append(acted[-rows:])
    heights = [thumbnail(f.image, thumb_width).height for col in columns for f in col] or [thumb_width]
    panel_h = max(heights) / 100
    fig = ReportFigure(figsize=(cols * thumb_width / 100 + 0.2, rows * (panel_h + 0.35) + 0.55), dpi=100,
                 layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for c in range(cols):
        for r in range(rows):
            ax = axes[r][c]
            ax.set_xticks([])
            ax.set_yticks([])
            col = columns[c] if c < len(columns) else []
            # Bottom-align: the last frame is always in the last row.
            offset = rows - len(col)
            if r < offset:
                ax.set_visible(False)
                continue
            frame = col[r - offset]
            ax.imshow(thumbnail(frame.image, thumb_width))
            ax.set_title(_wrap(f"{frame.title}: {frame.action_text}", thumb_width // 7, 2), fontsize=6,
                         loc="left")
        if c >= len(members):
            continue
        member = members[c][1]
        replayed = bool(member.get("replayed", False))
        top = axes[rows - len(columns[c])][c] if columns[c] else axes[0][c]
        header = (f"#{c}  reward {float_or_none(member.get('reward')) or 0:.2f}\n"
                  f"adv {float_or_none(member.get('advantage')) or 0:+.2f} · "
                  f"{'replayed' if replayed else 'fresh'}")
        top.set_title(header + "\n" + top.get_title(loc="left"), fontsize=7, loc="left",
                      color=REPLAYED_COLOUR if replayed else "black",
                      fontweight="bold" if replayed else "normal")
        if replayed:
            for r in range(rows):
                for spine in axes[r][c].spines.values():
                    spine.set_edgecolor(REPLAYED_COLOUR)
                    spine.set_linewidth(4)
    fig.suptitle(f"step {step} · {task}", fontsize=9, x=0.01, ha="left")
    return fig


def figure_png(fig: Any, dpi: int = 100) -> bytes:
    """PNG bytes of a matplotlib Figure (headless: no pyplot, no GUI backend)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
