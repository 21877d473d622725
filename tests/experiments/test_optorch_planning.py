"""OpTorch's sequential checkpoints measured (Figs 8 and 11, the planner front, the unit floor)."""

from __future__ import annotations

import math

import matplotlib
import pandas as pd
from matplotlib.figure import Figure

from workbench.experiments.optorch import (
    experiment_checkpoint_position,
    experiment_floor,
    experiment_planner_pareto,
    experiment_sc_resnet,
    floor_summary,
    optimal_vs_uniform,
    plot_checkpoint_position,
    plot_memory_over_iteration,
    plot_pareto,
    plot_prediction,
    plot_unit_floor,
    smallest_layer_rank,
)

matplotlib.use("Agg")
TINY = {"width": 4 / 64, "image_size": 8, "batch": 4}


def test_sc_resnet_summary_and_trace(one_thread) -> None:
    summary, trace, floor = experiment_sc_resnet(repeats=1, **TINY)
    assert list(summary.variant) == ["B", "S-C uniform", "S-C optimal, block boundaries", "S-C optimal"]
    assert summary.peak_ratio.iloc[0] == 1.0 and summary.time_ratio.iloc[0] == 1.0
    assert (summary.peak_bytes.iloc[1:] < summary.peak_bytes.iloc[0]).all()
    assert set(trace.variant) == set(summary.variant)
    assert trace.groupby("variant").bytes.max().to_dict() == summary.set_index(
        "variant").peak_bytes.to_dict()
    # the cost model (plus the input batch) never under-predicts a measured peak
    assert (summary.prediction_error >= 0).all()
    assert (summary.time_ratio_lo <= summary.time_ratio_hi).all()
    assert (floor.floor_ratio <= summary.min_predicted_ratio.iloc[0] + 1e-12).all()
    assert isinstance(plot_memory_over_iteration(trace), Figure)


def test_sc_resnet_shows_progress_through_every_stage(one_thread, capsys) -> None:
    experiment_sc_resnet(repeats=1, progress=True, **TINY)
    err = capsys.readouterr().err
    assert "profiling units" in err and "measuring S-C optimal" in err and "timing 4 variants" in err


def test_floor_rows_and_plot(one_thread) -> None:
    df = experiment_floor(("cifar", "imagenet"), **TINY)
    assert set(df.stem) == {"cifar", "imagenet"}
    for _, g in df.groupby("stem"):
        assert g.floor_ratio.max() <= g.min_plan_ratio.iloc[0] + 1e-12
    top = floor_summary(df)
    assert list(top.stem) == ["cifar", "imagenet"]
    for _, row in top.iterrows():
        assert row.floor_ratio == df[df.stem == row.stem].floor_ratio.max()
    assert isinstance(plot_unit_floor(df), Figure)


def test_checkpoint_position_rows(one_thread) -> None:
    df = experiment_checkpoint_position(widths=(32, 16, 4, 16, 32), batch=8)
    assert list(df.boundary) == [0, 1, 2, 3] and df.is_smallest.sum() == 1
    assert (df.prediction_error >= 0).all()
    assert df.loc[df.is_smallest, "stored_width"].item() == 4
    assert df.widths.iloc[0] == "32,16,4,16,32"
    assert 1 <= smallest_layer_rank(df) <= 3
    assert isinstance(plot_checkpoint_position(df), Figure)


def test_smallest_layer_rank_orders_by_measured_peak_then_position() -> None:
    df = pd.DataFrame({"boundary": [0, 1, 2, 3], "measured_peak_bytes": [9, 5, 6, 5],
                       "is_smallest": [False, False, True, False]})
    assert smallest_layer_rank(df) == 3
    assert smallest_layer_rank(df.assign(measured_peak_bytes=[9, 5, 4, 5])) == 1
    # records read back from results.json: booleans may come as objects
    assert smallest_layer_rank(df.assign(is_smallest=df.is_smallest.astype(object))) == 3


def test_planner_pareto_optimal_no_slower_in_prediction(one_thread) -> None:
    df = experiment_planner_pareto(budgets=2, repeats=1, progress=False, **TINY)
    for _, group in df.groupby("budget_bytes"):
        opt = group[group.strategy == "optimal"].predicted_recompute_s.item()
        others = group[group.strategy != "optimal"].predicted_recompute_s.dropna()
        assert all(opt <= o + 1e-12 for o in others)
        assert not math.isnan(opt)
    measured = df.dropna(subset=["measured_peak_bytes"])
    assert (measured.prediction_error >= 0).all() and not measured.over_budget.any()
    versus = optimal_vs_uniform(df)
    assert (versus.predicted_recompute_ratio <= 1 + 1e-12).all()
    # the same table from the records as results.json keeps them (plans as strings)
    pd.testing.assert_frame_equal(optimal_vs_uniform(df.assign(plan=df.plan.astype(str))), versus)
    assert isinstance(plot_pareto(df), Figure)
    frame = pd.DataFrame({"predicted_peak_bytes": [2.0, 3.0], "measured_peak_bytes": [1.9, 3.0]})
    assert isinstance(plot_prediction({"a": frame, "front": df}), Figure)


def test_optimal_vs_uniform_pairs_the_extremes_and_skips_budgets_without_both() -> None:
    rows = [  # budget 1: only optimal plans; budget 2: the same plan; budget 3: different plans
        (1, "uniform", None, math.nan, math.nan, math.nan), (1, "optimal", [[0, 2, 1]], 0.1, 1.0, 1.2),
        (2, "uniform", [[0, 4, 0]], 0.0, 1.0, 1.1), (2, "optimal", [[0, 4, 0]], 0.0, 1.0, 1.1),
        (3, "uniform", [[0, 2, 1]], 0.4, 2.0, 2.5), (3, "optimal", [[0, 3, 1]], 0.2, 1.5, 1.8),
    ]
    df = pd.DataFrame(rows, columns=["budget_bytes", "strategy", "plan", "predicted_recompute_s", "min_s", "max_s"])
    out = optimal_vs_uniform(df).set_index("budget_bytes")
    assert list(out.index) == [2, 3] and list(out.differ) == [False, True]
    assert out.predicted_recompute_ratio[2] == 1.0 and out.predicted_recompute_ratio[3] == 0.5
    assert out.time_ratio[3] == 1.5 / 2.0
    assert out.time_ratio_lo[3] == 1.5 / 2.5 and out.time_ratio_hi[3] == 1.8 / 2.0
