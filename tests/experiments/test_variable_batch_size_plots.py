"""variable_batch_size.plots: pure functions, a DataFrame in and a labelled Figure out."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

import workbench.experiments.variable_batch_size as exp  # noqa: E402
from workbench import vbs  # noqa: E402


@pytest.fixture(scope="module")
def sweep():
    b = np.arange(1, 5)
    size = np.array([48, 64, 32, 16]) * 1024
    tables = vbs.LayerProfile(1e-3 / b * np.ones((3, 1)), size[:-1, None] * b, size[1:, None] * b, np.zeros((3, 4)))
    return exp.budget_sweep({"googlenet": tables}, requests=[2, 4], ratios=[1.0, 2.0]), tables


def _labelled(fig) -> bool:
    return all(ax.get_xlabel() and ax.get_ylabel() for ax in fig.axes[:1])


def test_every_plot_is_a_labelled_figure(sweep):
    frame, tables = sweep
    fig1 = pd.DataFrame({"network": ["resnet50"] * 2, "batch": [1, 2], "time_per_image_s": [2e-3, 1e-3]})
    figs = [exp.plot_time_vs_batch(fig1), exp.plot_layer_memory(exp.layer_memory(tables)),
            exp.plot_budget_sweep(frame, request=4, executed=False), exp.plot_request_sizes(frame, executed=False),
            exp.plot_layer_batches(exp.layer_batches(frame, tables, network="googlenet", ratio=1.0, request=4)),
            exp.plot_planner_timing(exp.planner_timing(layers=[3], memory_units=[8], batch=2, repeats=1))]
    for fig in figs:
        assert isinstance(fig, matplotlib.figure.Figure) and _labelled(fig)
        plt.close(fig)
    assert "ms" in figs[0].axes[0].get_ylabel() and "MiB" in figs[1].axes[0].get_ylabel()
    assert len(figs[3].axes) == 2  # one panel per request size
