"""The notebook's explore widget as one function: a network, a budget and a request in, the DP's plan
against FBS and Greedy-VBS (predicted from the measured tables) and its batch sizes per layer out.

Kept here, not in the notebook, so that the widget's figure carries the same toy-scale mark as the
report's figures (`verdicts`, the notebook parameter that turns the ledger's verdicts on).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

from workbench import vbs

from .budgets import budget_sweep, plan_at_ratio
from .plots import plot_layer_batches

__all__ = ["explore_budget"]

_COLUMNS = ["method", "feasible", "paper_mb", "budget_bytes", "time_per_image_s", "max_batch"]


def explore_budget(
    layers: dict[str, vbs.LayerProfile], *, network: str, ratio: float, request: int, units_at_floor: int,
    verdicts: bool,
) -> tuple[pd.DataFrame, Figure]:
    """(the three methods at `ratio` x floor for a request of `request`, the DP's batch sizes per layer).

    The figure is closed in pyplot before it is returned: show it with `display(fig)`."""
    if network not in layers:
        raise ValueError(f"network must be one of {list(layers)}, got {network!r}")
    one = budget_sweep({network: layers[network]}, requests=[request], ratios=[ratio],
                       units_at_floor=units_at_floor, floor_batch=request)
    plan = plan_at_ratio(one, network=network, method="vbs", ratio=ratio, request=request, kept=False)
    fig = plot_layer_batches(plan.to_frame(), title=f"{network}: batch sizes at {ratio} x floor, request {request}",
                             verdicts=verdicts)
    # NOTE: ipywidgets' interact shows every figure still open in pyplot after the callback returns;
    # a figure the callback displays as well would be drawn twice. Closed here, it is drawn once.
    plt.close(fig)
    return one[_COLUMNS].reset_index(drop=True), fig
