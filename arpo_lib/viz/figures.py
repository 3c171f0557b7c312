"""What every figure of the workbench shares: `ReportFigure` (a Figure that shows itself in any
notebook output), `save_figure`, and the empty-panel note."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure


class ReportFigure(Figure):
    """A Figure that shows itself as a PNG in any IPython/Jupyter output.

    Our figures are built without pyplot (headless-safe, never shown twice), so no backend
    registers a display hook for them; this `_repr_png_` makes a bare `plot_training(run)` at
    the end of a cell render, in JupyterLab, Colab, papermill and nbval alike.
    """

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=80)
        return buf.getvalue()


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write `fig` as a PNG (dpi 100, tight bounding box), creating parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path


def no_data(ax: Any) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="0.5")
