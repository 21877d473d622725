"""The marks every notebook figure carries (issues 23 and 44): where the notebook gives no verdicts, or judges
our targets on reduced models, a toy-scale banner above the axes (a toy run can show the opposite of the paper);
where the figure's measurement has a scale and a device, a line below saying which."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["TOY_SCALE", "marked"]

TOY_SCALE = "toy scale: verdicts off, not evidence (see the ledger)"


def marked(fig: Figure, verdicts: bool, scale: str = "", *, reduced: str = "") -> Figure:
    """`fig` laid out, then marked: `TOY_SCALE` above its top edge where `verdicts` (the notebook parameter that
    also turns the ledger's verdicts off) is False, or toy scale with `reduced` (the models' widths and resolution)
    where verdicts are on but the models are reduced; `scale` below it."""
    if not isinstance(verdicts, bool):
        raise TypeError(f"verdicts must be a bool (the notebook parameter), got {verdicts!r}")
    fig.tight_layout()  # first: the marks sit outside the laid-out axes
    banner = TOY_SCALE if not verdicts else f"toy scale: {reduced} (our targets are judged at it)" if reduced else ""
    if banner:
        fig.text(0.5, 1.0, banner, ha="center", va="bottom", fontsize=9, color="white", fontweight="bold",
                 bbox={"boxstyle": "round", "facecolor": "C3", "edgecolor": "none"})
    if scale:
        fig.text(0.01, 0.0, f"scale: {scale}", ha="left", va="top", fontsize=8, color="0.35", wrap=True)
    return fig
