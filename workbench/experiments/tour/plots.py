"""The tour's figure: live tensor memory over one training step (`workbench.measure.plot_memory_trace`),
marked where the notebook gives no verdicts.

`verdicts` is the notebook parameter that also turns the ledger's verdicts on: a figure made where
it is False (the small defaults, the smoke profile) carries `TOY_SCALE` on itself.
"""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from workbench.measure import plot_memory_trace
from workbench.report.marks import TOY_SCALE, marked

__all__ = ["TOY_SCALE", "plot_step_trace"]


def plot_step_trace(traces: dict[str, pd.DataFrame], *, title: str = "Memory over one step",
                    verdicts: bool = True) -> Figure:
    """Live tensor memory (MiB) against allocation event, one line per labelled trace."""
    return marked(plot_memory_trace(traces, title=title), verdicts)
