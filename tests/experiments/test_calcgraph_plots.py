"""The CalcGraph notebook's figures: pure functions of their records, axes labelled with units."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from workbench.experiments import calcgraph as cgx  # noqa: E402


def _labelled(fig):
    try:
        assert all(ax.get_xlabel() or ax.get_xticklabels() for ax in fig.axes)
        assert any(ax.get_ylabel() for ax in fig.axes)
    finally:
        plt.close(fig)


def test_every_plot_draws_its_record():
    _labelled(cgx.plot_prediction_error(pd.DataFrame({
        "model": ["mlp", "mlp"], "batch_size": [1, 2], "predicted_bytes": [10, 20], "measured_bytes": [10, 20],
        "error": [0.0, 0.0], "meter": "live-storage tracker"})))
    _labelled(cgx.plot_accuracy(pd.DataFrame({"round": [1, 1], "framework": ["calcgraph heap", "pytorch"],
                                              "train_accuracy": [0.5, 0.5], "test_accuracy": [0.4, 0.4]})))
    _labelled(cgx.plot_single_model(pd.DataFrame({
        "framework": ["calcgraph heap", "pytorch"], "predicted_peak_bytes": [1e6, 1e6],
        "measured_peak_bytes": [1e6, 1e6],
        "round_median_s": [0.1, 0.1], "round_min_s": [0.09, 0.09], "round_max_s": [0.11, 0.11]})))
    _labelled(cgx.plot_multi_model(pd.DataFrame({"complexity": [1, 10], "run": [True, True], "plain_s": [1.0, 2.0],
                                                 "switching_s": [0.5, 1.9]})))
    _labelled(cgx.plot_parallel(pd.DataFrame({
        "mode": ["loop"], "budget_bytes": [2**22], "planned_models": [3], "trial_models": [3], "trials": [4],
        "pytorch_models": [3], "pytorch_trials": [4]})))
    _labelled(cgx.plot_peers(pd.DataFrame({"method": ["calcgraph (plan)", "accelerate"], "max_batch": [10, None],
                                           "trials": [0, None], "seconds": [0.1, None]})))
