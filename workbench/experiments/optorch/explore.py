"""The notebook's explore widget as one function: Fig 8's iteration (baseline against the ``sc``
variants) at a batch and image size picked by hand, with a progress bar while it runs.

Kept here, not in the notebook, so that the widget draws its figure once and marks it like the
report's figures (`verdicts`, the notebook parameter that turns the ledger's verdicts on).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import torch
from matplotlib.figure import Figure

from .planning import experiment_sc_resnet
from .plots import plot_memory_over_iteration

__all__ = ["explore_sc"]

_COLUMNS = ["variant", "peak_bytes", "predicted_peak_bytes", "prediction_error", "peak_ratio"]


def explore_sc(
    *, model: str, batch: int, image_size: int, width: float, device: torch.device | str, seed: int = 0,
    stem: str = "cifar", verdicts: bool,
) -> tuple[pd.DataFrame, Figure]:
    """(the variants' peaks against the prediction, memory over the iteration) for one setting.

    The bar of `experiment_sc_resnet` shows each stage (profiling, the four measured variants, the
    timing round) and tqdm's estimate of the time left, so a large setting is not a blank wait.
    The figure is closed in pyplot before it is returned: show it with `display(fig)`.
    """
    summary, trace, _ = experiment_sc_resnet(model=model, batch=batch, image_size=image_size, width=width,
                                             device=device, repeats=1, seed=seed, stem=stem, progress=True)
    fig = plot_memory_over_iteration(trace, title=f"{model}, {batch} images {image_size}x{image_size}",
                                     verdicts=verdicts)
    # NOTE: ipywidgets' interact shows every figure still open in pyplot after the callback returns;
    # a figure the callback displays as well would be drawn twice. Closed here, it is drawn once.
    plt.close(fig)
    return summary[_COLUMNS].reset_index(drop=True), fig
