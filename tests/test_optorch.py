"""OpTorch pipelines: each switch against the baseline, and the experiment/plot functions."""

from __future__ import annotations

import math

import matplotlib
import pytest
import torch
from matplotlib.figure import Figure

from workbench.data import ImageSet, normalize
from workbench.data.encode import capacity_study, encode
from workbench.devices import seed_everything
from workbench.experiments.optorch import (
    PIPELINES,
    Pipeline,
    autoencoder,
    build_model,
    experiment_checkpoint_position,
    experiment_floor,
    experiment_pipeline_memory,
    experiment_planner_pareto,
    experiment_sbs,
    experiment_sc_resnet,
    experiment_time_accuracy,
    hook_retained_bytes,
    measure_step,
    meter_retained_bytes,
    prepare,
)
from workbench.experiments.optorch import (
    plot_capacity,
    plot_checkpoint_position,
    plot_memory_over_iteration,
    plot_pareto,
    plot_peer,
    plot_pipeline_memory,
    plot_prediction,
    plot_time_accuracy,
    plot_unit_floor,
)

matplotlib.use("Agg")
TINY = {"width": 4, "image_size": 8, "batch": 4}


def test_the_six_pipelines() -> None:
    assert list(PIPELINES) == ["B", "E-D", "M-P", "S-C", "E-D+S-C", "M-P+S-C", "E-D+M-P+S-C"]
    assert PIPELINES["E-D+M-P+S-C"] == Pipeline(True, True, True)


def test_prepare_switches_match_baseline() -> None:
    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    seed_everything(0)
    base = build_model("resnet18", width=4)
    ref = base(normalize(images))
    for name in ("E-D", "S-C", "E-D+S-C"):
        model, dtype, scaler = prepare(base, PIPELINES[name], device="cpu")
        assert dtype is None and scaler is None
        x = encode(images, scheme="int64") if PIPELINES[name].encode else normalize(images)
        torch.testing.assert_close(model(x), ref)
    _, dtype, scaler = prepare(base, PIPELINES["M-P"], device="cpu")
    assert dtype == torch.bfloat16 and scaler is None


def test_build_model_rejects_unknown() -> None:
    with pytest.raises(ValueError, match="resnet18"):
        build_model("vgg16")


def test_time_accuracy_same_batches_give_same_training() -> None:
    g = torch.Generator().manual_seed(0)
    data = ImageSet(torch.randint(0, 256, (24, 1, 8, 8), dtype=torch.uint8, generator=g),
                    torch.arange(24) % 3, 3, "tiny")
    train, test = data.split(0.25, seed=0)
    df = experiment_time_accuracy(train, test, width=4, epochs=2, batch_size=6,
                                  pipelines=("B", "E-D", "S-C", "E-D+S-C", "M-P"), progress=False)
    # the baseline augments and normalises per batch in the training thread, E-D in its thread:
    # the same random flips and crops, so the losses match exactly
    assert df.augment.all()
    assert len(df) == 10 and {"test_acc", "robust_cum_seconds", "median_step_s"} <= set(df.columns)
    loss = df.pivot(index="epoch", columns="pipeline", values="loss")
    # exact encoding and exact recomputation leave training unchanged
    for name in ("E-D", "S-C", "E-D+S-C"):
        torch.testing.assert_close(torch.tensor(loss[name].values), torch.tensor(loss["B"].values))
    assert isinstance(plot_time_accuracy(df), Figure)


def test_pipeline_memory_rows_and_checkpoint_saves() -> None:
    df = experiment_pipeline_memory(("resnet18",), batch=8, image_size=16, width=8,
                                    pipelines=("B", "S-C", "E-D"), progress=False)
    peaks = df.set_index("pipeline").peak_bytes
    assert df.set_index("pipeline").ratio_vs_B["B"] == 1.0
    assert peaks["S-C"] < peaks["B"]
    assert isinstance(plot_pipeline_memory(df), Figure)


def test_sc_resnet_summary_and_trace() -> None:
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


def test_measure_step_counts_the_input_alike() -> None:
    """B's float batch and E-D's encoded batch both cross inside the measured region."""
    images = torch.randint(0, 256, (8, 3, 8, 8), dtype=torch.uint8)
    labels = torch.arange(8) % 10
    seed_everything(0)
    base = build_model("resnet18", width=4)
    peaks = {}
    for name in ("B", "E-D"):
        model, _, _ = prepare(base, PIPELINES[name], device="cpu")
        peaks[name], _ = measure_step(model, images, labels, PIPELINES[name], device="cpu")
    # E-D holds the same float batch as B, plus at most its encoded words (uint8-sized)
    assert 0 <= peaks["E-D"] - peaks["B"] <= encode(images, scheme="int64").nbytes


def test_floor_rows_and_plot() -> None:
    df = experiment_floor(("cifar", "imagenet"), **TINY)
    assert set(df.stem) == {"cifar", "imagenet"}
    for _, g in df.groupby("stem"):
        assert g.floor_ratio.max() <= g.min_plan_ratio.iloc[0] + 1e-12
    assert isinstance(plot_unit_floor(df), Figure)


def test_sbs_through_encoding() -> None:
    g = torch.Generator().manual_seed(0)
    data = ImageSet(torch.randint(0, 256, (60, 1, 6, 6), dtype=torch.uint8, generator=g),
                    torch.arange(60) % 10, 10, "tiny")
    weights = [0.05] * 10
    weights[3], weights[8] = 0.3, 0.3
    batches, shares = experiment_sbs(data, weights, batch_size=16, num_batches=5)
    assert (batches.max_diff_vs_unencoded == 0).all()
    assert (shares.abs_error <= 1 / 80 + 1e-12).all()
    assert batches[[f"class {c}" for c in range(10)]].sum(axis=1).eq(16).all()


def test_retained_bytes_agree_on_eager() -> None:
    net = autoencoder((16, 8, 4, 8, 16))
    x = torch.randn(32, 16)

    def step():
        out = net(x)
        return out.square().mean(), out
    hooks, loss = hook_retained_bytes(step, [*net.parameters(), x])
    loss.backward()
    meter, peak = meter_retained_bytes(step, torch.device("cpu"))
    assert abs(hooks - meter) <= 16 and peak >= meter  # the loss scalar is all that differs


def test_peer_and_prediction_plots() -> None:
    import pandas as pd

    df = pd.DataFrame({"method": ["ours", "ours", "torch", "torch"], "fraction": [1.0, 0.5, 1.0, 0.5],
                       "retained_ratio": [1.0, 0.6, 0.9, 0.5], "time_ratio": [1.0, 1.2, 0.8, 0.9],
                       "time_ratio_lo": [0.9, 1.1, 0.7, 0.8], "time_ratio_hi": [1.1, 1.3, 0.9, 1.0]})
    assert isinstance(plot_peer(df), Figure)
    frame = pd.DataFrame({"predicted_peak_bytes": [2.0, 3.0], "measured_peak_bytes": [1.9, 3.0]})
    assert isinstance(plot_prediction({"a": frame}), Figure)


def test_checkpoint_position_rows() -> None:
    df = experiment_checkpoint_position(widths=(32, 16, 4, 16, 32), batch=8)
    assert list(df.boundary) == [0, 1, 2, 3] and df.is_smallest.sum() == 1
    assert (df.prediction_error >= 0).all()
    assert df.loc[df.is_smallest, "stored_width"].item() == 4
    assert isinstance(plot_checkpoint_position(df), Figure)


def test_planner_pareto_optimal_no_slower_in_prediction() -> None:
    df = experiment_planner_pareto(budgets=2, repeats=1, progress=False, **TINY)
    for _, group in df.groupby("budget_bytes"):
        opt = group[group.strategy == "optimal"].predicted_recompute_s.item()
        others = group[group.strategy != "optimal"].predicted_recompute_s.dropna()
        assert all(opt <= o + 1e-12 for o in others)
        assert not math.isnan(opt)
    measured = df.dropna(subset=["measured_peak_bytes"])
    assert (measured.prediction_error >= 0).all() and not measured.over_budget.any()
    assert isinstance(plot_pareto(df), Figure)


def test_capacity_plot() -> None:
    df = capacity_study(torch.randint(0, 256, (4, 1, 2, 2), dtype=torch.uint8), max_per_element=9)
    assert isinstance(plot_capacity(df), Figure)
