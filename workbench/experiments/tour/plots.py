"""The tour's figure: live tensor memory over one training step (`workbench.measure.plot_memory_trace`),
marked where the notebook gives no verdicts.

`verdicts` is the notebook parameter that also turns the ledger's verdicts on: a figure made where
it is False (the small defaults, the smoke profile) carries `TOY_SCALE` on itself.
"""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from workbench.measure import plot_memory_trace

__all__ = ["TOY_SCALE", "plot_step_trace"]

TOY_SCALE = "toy scale: verdicts off, not evidence (see the ledger)"


def _marked(fig: Figure, verdicts: bool) -> Figure:
    """`fig` laid out and, where `verdicts` is False, marked `TOY_SCALE` above its top edge."""
    if not isinstance(verdicts, bool):
        raise TypeError(f"verdicts must be a bool (the notebook parameter), got {verdicts!r}")
    fig.tight_layout()  # first: the mark sits above the laid-out axes
    if not verdicts:
        fig.text(0.5, 1.0, TOY_SCALE, ha="center", va="bottom", fontsize=9, color="white", fontweight="bold",
                 bbox={"boxstyle": "round", "facecolor": "C3", "edgecolor": "none"})
    return fig


def plot_step_trace(traces: dict[str, pd.DataFrame], *, title: str = "Memory over one step",
                    verdicts: bool = True) -> Figure:
    """Live tensor memory (MiB) against allocation event, one line per labelled trace."""
    return _marked(plot_memory_trace(traces, title=title), verdicts)
