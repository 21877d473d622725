"""The efficient DenseNet notebook's experiment functions added for the honest ledger: the per-sample
extrapolation to a memory budget, the BN time share, the contiguity spread, parity, parameter counts."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

import workbench.experiments.efficient_densenet as bench
import workbench.experiments.efficient_densenet.timing as timing
from workbench.models.densenet import densenet_bc


def _sweep(per_sample, depths=(16, 40, 64, 100), batch_size=2) -> pd.DataFrame:
    return pd.DataFrame([{"form": form, "depth": d, "growth_rate": 12, "batch_size": batch_size,
                          "activation_peak_bytes": batch_size * f(d), "params": 0}
                         for form, f in per_sample.items() for d in depths])


def test_extrapolate_to_budget_finds_the_deepest_depth_that_fits() -> None:
    per_sample = {"luatorch": lambda d: 1000.0 * d * d + 5e4 * d, "shared_max": lambda d: 2e5 * d + 1e6}
    df = _sweep(per_sample)
    budget = 4 * 2**30
    out = bench.extrapolate_to_budget(df, budget, batch_size=64, max_depth=406).set_index("form")

    def predicted(form, depth):
        return 64 * per_sample[form](depth) + 3 * 4 * bench.cifar_bc_params(depth, 12)

    for form in per_sample:
        depth = int(out.loc[form, "deepest_depth"])
        assert (depth - 4) % 6 == 0 and not out.loc[form, "capped"]
        assert predicted(form, depth) <= budget < predicted(form, depth + 6), form
        assert out.loc[form, "params"] == bench.cifar_bc_params(depth, 12)
        assert math.isclose(out.loc[form, "predicted_bytes"], predicted(form, depth), rel_tol=1e-9)
    assert out.loc["luatorch", "fit_c2"] == pytest.approx(1000.0)
    capped = bench.extrapolate_to_budget(df, 2**50, batch_size=64, max_depth=100).set_index("form")
    assert capped["capped"].all() and (capped["deepest_depth"] == 100).all()
    none_fit = bench.extrapolate_to_budget(df, 1.0, batch_size=64, max_depth=100)
    assert none_fit["deepest_depth"].isna().all()


def test_extrapolate_never_bends_down() -> None:
    # a slightly concave sweep (quadratic coefficient < 0) is extrapolated linearly instead
    df = _sweep({"shared": lambda d: 1e5 * d - 10.0 * d * d + 1e6})
    out = bench.extrapolate_to_budget(df, 2**30, batch_size=64, max_depth=406).iloc[0]
    assert out["fit_c2"] == 0.0 and out["fit_c1"] > 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(budget_bytes=0), "budget_bytes=0"),
    (dict(budget_bytes=1e9, batch_size=0), "batch_size=0"),
    (dict(budget_bytes=1e9, forms=("lua",)), "forms="),
])
def test_extrapolate_rejects_bad_input(kwargs, match) -> None:
    df = _sweep({"naive": lambda d: 1e5 * d})
    with pytest.raises(ValueError, match=match):
        bench.extrapolate_to_budget(df, **kwargs)


def test_contiguity_ratio_spread_is_the_median_taken_round_by_round() -> None:
    conv = pd.DataFrame([
        {"in_channels": 8, "layout": "contiguous", "ratio_to_contiguous": 1.0, "round_ratios": [1.0] * 3},
        {"in_channels": 8, "layout": "non-contiguous", "ratio_to_contiguous": 1.2, "round_ratios": [1.1, 1.2, 1.6]},
        {"in_channels": 16, "layout": "contiguous", "ratio_to_contiguous": 1.0, "round_ratios": [1.0] * 3},
        {"in_channels": 16, "layout": "non-contiguous", "ratio_to_contiguous": 1.4, "round_ratios": [1.3, 1.5, 1.4]},
    ])
    value, lo, hi = bench.contiguity_ratio(conv)
    assert value == pytest.approx(1.3)
    assert (lo, hi) == pytest.approx((np.median([1.1, 1.3]), np.median([1.6, 1.4])))


def test_bn_time_share_times_a_model_without_batch_norm(one_thread, monkeypatch) -> None:
    seen = {}
    real = timing.time_interleaved

    def spy(fns, **kw):
        seen.update(fns)
        return real(fns, **kw)

    monkeypatch.setattr(timing, "time_interleaved", spy)
    df = bench.bn_time_share(10, growth_rate=4, batch_size=2, image_size=8, rounds=2, warmup=0,
                             device="cpu", progress=False).set_index("variant")
    assert set(df.index) == {"with BN", "without BN"}
    row = df.iloc[0]
    assert row["bn_share_min"] <= row["bn_share"] <= row["bn_share_max"] < 1
    models = {k: fn.__closure__[0].cell_contents for k, fn in seen.items()}
    count = {k: sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) for k, model in models.items()}
    assert count["without BN"] == 0 and count["with BN"] > 0
    with pytest.raises(ValueError, match="rounds=0"):
        bench.bn_time_share(10, rounds=0)


def test_parity_of_every_variant() -> None:
    df = bench.parity(10, growth_rate=4, batch_size=2, image_size=8).set_index("form")
    assert set(df.index) == set(bench.VARIANTS)
    assert (df["max_rel_grad_diff"] < 1e-5).all() and (df["max_abs_output_diff"] < 1e-5).all()
    assert (df["num_batches_tracked"] == 1).all()


@pytest.mark.parametrize("depth, k, classes", [(10, 12, 10), (40, 12, 10), (100, 12, 10), (160, 12, 10),
                                               (22, 7, 3), (232, 12, 100)])
def test_cifar_parameter_arithmetic_matches_built_models(depth, k, classes) -> None:
    with torch.device("meta"):
        model = densenet_bc(depth, k, classes)
    assert bench.cifar_bc_params(depth, k, classes) == sum(p.numel() for p in model.parameters())


def test_parameter_counts_table() -> None:
    df = bench.parameter_counts([(40, 12, 10, False), (232, 48, 1000, True), (232, 12, 10, None)])
    assert list(df["params"][:1]) == [176_122]  # the paper says 160K
    assert list(df["network"]) == ["CIFAR", "ImageNet", "CIFAR"]
    assert df["block_config"].iloc[1] == [6, 12, 48, 48]


def test_luatorch_and_max_buffer_variants_in_the_sweep(one_thread) -> None:
    df = bench.memory_vs_depth([16, 28], forms=("luatorch", "naive", "shared", "shared_max"),
                               batch_size=2, image_size=16, device="cpu", progress=False)
    peak = df.pivot(index="depth", columns="form", values="activation_peak_bytes")
    assert (peak["luatorch"] > peak["naive"]).all()
    assert (peak["shared"] < peak["shared_max"]).all() and (peak["shared_max"] < peak["naive"]).all()
    budget = bench.deepest_within_budget(df, float(peak.loc[16, "luatorch"]), baseline="luatorch")
    assert (budget["baseline"] == "luatorch").all()
    assert budget.set_index("form").loc["luatorch", "depth_ratio"] == 1.0
