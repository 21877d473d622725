"""The efficient DenseNet notebook's Section 5 experiments: the deepest model within a budget (measured,
and extrapolated per sample to the paper's scale) and the parameter counts."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

import workbench.experiments.efficient_densenet as bench
from workbench.models import densenet_bc


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


def test_extrapolate_defaults_to_the_papers_scale() -> None:
    out = bench.extrapolate_to_budget(_sweep({"shared_max": lambda d: 2e5 * d + 1e6})).iloc[0]
    assert out["budget_bytes"] == bench.PAPER_BUDGET_BYTES == 12 * 2**30
    assert out["batch_size"] == bench.PAPER_BATCH_SIZE == 64


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


def test_memory_budget_is_the_baselines_peak_at_a_depth() -> None:
    df = _sweep({"luatorch": lambda d: 100.0 * d * d, "shared_max": lambda d: 1000.0 * d})
    out = bench.memory_budget(df, 40).set_index("form")
    assert (out["budget_bytes"] == 2 * 100.0 * 40 * 40).all() and (out["budget_depth"] == 40).all()
    assert out.loc["luatorch", "deepest_depth"] == 40 and out.loc["luatorch", "depth_ratio"] == 1.0
    assert out.loc["shared_max", "deepest_depth"] == 100 and out.loc["shared_max", "limited_by_sweep"]
    assert out.loc["shared_max", "depth_ratio"] == pytest.approx(100 / 40)
    assert bench.memory_budget(df, 22).empty  # not in the sweep
    with pytest.raises(ValueError, match="budget_bytes"):
        bench.deepest_within_budget(df, 0)


def test_deepest_within_budget_edges() -> None:
    mem = pd.DataFrame([{"form": f, "depth": d, "params": d, "activation_peak_bytes": b}
                        for f, d, b in (("naive", 10, 5.0), ("naive", 16, 9.0), ("shared", 10, 3.0),
                                        ("shared", 16, 4.0))])
    out = bench.deepest_within_budget(mem, 4.0).set_index("form")
    assert math.isnan(out.loc["naive", "deepest_depth"])
    assert out.loc["shared", "deepest_depth"] == 16 and out.loc["shared", "limited_by_sweep"]
    with pytest.raises(ValueError, match="budget_bytes=0"):
        bench.deepest_within_budget(mem, 0)


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


def test_the_papers_models_are_all_counted() -> None:
    df = bench.parameter_counts(bench.PAPER_MODELS)
    assert list(zip(df["depth"], df["growth_rate"], strict=True)) == [m[:2] for m in bench.PAPER_MODELS]
    assert df.set_index(["depth", "growth_rate"]).loc[(264, 48), "block_config"] == [6, 12, 64, 48]
