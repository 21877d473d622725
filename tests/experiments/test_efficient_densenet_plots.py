"""The efficient DenseNet notebook's plots: pure functions of the experiments' DataFrames, axes labelled
with units."""

from __future__ import annotations

import matplotlib
import pytest

import workbench.experiments.efficient_densenet as bench

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def sweep():
    return bench.memory_vs_depth([10, 16, 22], forms=("luatorch", "naive", "shared"), growth_rate=4, batch_size=1,
                                 image_size=8, device="cpu", progress=False)


def test_memory_plot_labels_axes(sweep) -> None:
    fig = bench.plot_memory_vs_depth(sweep, bench.fit_growth_exponents(sweep))
    assert all(ax.get_xlabel() == "depth (layers)" and "MiB" in ax.get_ylabel() for ax in fig.axes)


def test_budget_time_and_conv_plots_label_axes(sweep) -> None:
    budget = bench.memory_budget(sweep, 16)
    fig = bench.plot_budget(budget)
    assert "layers" in fig.axes[0].get_ylabel() and "MiB" in fig.axes[0].get_title()
    timing = bench.time_per_minibatch(10, growth_rate=4, batch_size=1, image_size=8, rounds=1, warmup=0,
                                      device="cpu", progress=False)
    assert "(s)" in bench.plot_time_per_minibatch(timing).axes[0].get_ylabel()
    conv = bench.conv_contiguity((4,), out_channels=4, batch_size=1, image_size=8, repeats=1, device="cpu",
                                 progress=False)
    ax = bench.plot_conv_contiguity(conv).axes[0]
    assert "(ms)" in ax.get_ylabel() and ax.get_xlabel() == "input channels"
