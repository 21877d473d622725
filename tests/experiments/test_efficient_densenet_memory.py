"""The efficient DenseNet notebook's memory experiments (Fig 4): the sweep over depth and forms, the
growth exponents, the table, and the parity of every variant with the naive form."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

import workbench.experiments.efficient_densenet as bench
import workbench.experiments.efficient_densenet.memory as memory
from tests.conftest import requires_cuda


def test_parity_of_every_variant() -> None:
    df = bench.parity(10, growth_rate=4, batch_size=2, image_size=8).set_index("form")
    assert set(df.index) == set(bench.VARIANTS)
    assert (df["max_rel_grad_diff"] < 1e-5).all() and (df["max_abs_output_diff"] < 1e-5).all()
    assert (df["num_batches_tracked"] == 1).all()


def test_luatorch_and_max_buffer_variants_in_the_sweep(one_thread) -> None:
    df = bench.memory_vs_depth([16, 28], forms=("luatorch", "naive", "shared", "shared_max"),
                               batch_size=2, image_size=16, device="cpu", progress=False)
    peak = df.pivot(index="depth", columns="form", values="activation_peak_bytes")
    assert (peak["luatorch"] > peak["naive"]).all()
    assert (peak["shared"] < peak["shared_max"]).all() and (peak["shared_max"] < peak["naive"]).all()
    budget = bench.deepest_within_budget(df, float(peak.loc[16, "luatorch"]), baseline="luatorch")
    assert (budget["baseline"] == "luatorch").all()
    assert budget.set_index("form").loc["luatorch", "depth_ratio"] == 1.0
    table = bench.memory_table(df)
    assert table.loc[16, "naive / luatorch"] == pytest.approx(peak.loc[16, "naive"] / peak.loc[16, "luatorch"])
    assert table.loc[28, "shared"] == pytest.approx(peak.loc[28, "shared"] / 2**20)
    assert "luatorch / luatorch" not in table


def test_memory_vs_depth_rejects_unknown_forms() -> None:
    with pytest.raises(ValueError, match="forms="):
        bench.memory_vs_depth([10], forms=("lua",), progress=False)


def test_growth_exponents_are_log_log_slopes() -> None:
    depths = [10, 20, 40, 80]
    df = pd.DataFrame([{"form": "quad", "depth": d, "activation_peak_bytes": 3.0 * d * d} for d in depths]
                      + [{"form": "lin", "depth": d, "activation_peak_bytes": 5.0 * d} for d in depths]
                      + [{"form": "one", "depth": 10, "activation_peak_bytes": 1.0}])
    fits = bench.fit_growth_exponents(df).set_index("form")
    assert fits.loc["quad", "exponent"] == pytest.approx(2.0)
    assert fits.loc["quad", "local_exponent"] == pytest.approx(2.0)
    assert fits.loc["lin", "local_exponent"] == pytest.approx(1.0)
    assert math.isnan(fits.loc["one", "local_exponent"])


def test_memory_near_linear_for_efficient_forms(one_thread) -> None:
    df = bench.memory_vs_depth([16, 28, 40, 58], forms=("naive", "checkpoint", "shared"), batch_size=2,
                               image_size=16, device="cpu", progress=False)
    fits = bench.fit_growth_exponents(df).set_index("form")
    for form in ("checkpoint", "shared"):
        assert fits.loc[form, "exponent"] < 1.2, fits
        assert fits.loc[form, "local_exponent"] < 1.2, fits
    assert fits.loc["naive", "exponent"] > fits.loc["shared", "exponent"] + 0.3, fits
    deepest = df[df["depth"] == 58].set_index("form")["activation_peak_bytes"]
    assert deepest["shared"] < 0.6 * deepest["naive"]
    assert deepest["checkpoint"] < 0.6 * deepest["naive"]
    budget = bench.deepest_within_budget(df, float(deepest["shared"])).set_index("form")
    assert budget.loc["shared", "deepest_depth"] == 58
    assert budget.loc["shared", "limited_by_sweep"]
    assert budget.loc["naive", "deepest_depth"] < 58


@requires_cuda
def test_memory_near_linear_on_cuda() -> None:
    df = bench.memory_vs_depth([16, 28, 40], forms=("naive", "shared"), batch_size=32, image_size=32,
                               device="cuda", progress=False)
    fits = bench.fit_growth_exponents(df).set_index("form")
    assert fits.loc["shared", "local_exponent"] < 1.25, fits
    assert fits.loc["naive", "local_exponent"] > fits.loc["shared", "local_exponent"] + 0.2, fits


def test_out_of_memory_is_recorded_and_deeper_models_skipped(monkeypatch) -> None:
    real = memory.MemoryMeter

    class FailingMeter(real):  # naive "runs out of memory" from depth 16 on
        def __enter__(self):
            if self._fail:
                raise torch.OutOfMemoryError("simulated")
            return super().__enter__()

    calls = []
    real_step = memory.step_memory

    def step_memory(depth, form, **kw):
        calls.append((depth, form))
        FailingMeter._fail = form == "naive" and depth >= 16
        return real_step(depth, form, **kw)

    monkeypatch.setattr(memory, "MemoryMeter", FailingMeter)
    monkeypatch.setattr(memory, "step_memory", step_memory)
    df = memory.memory_vs_depth([10, 16, 22], forms=("naive", "shared"), batch_size=1, image_size=8,
                                device="cpu", progress=False)
    assert ((22, "naive") not in calls) and ((22, "shared") in calls)
    naive = df[df["form"] == "naive"].set_index("depth")
    assert list(naive["oom"]) == [False, True, True]
    assert naive["activation_peak_bytes"].iloc[1:].isna().all()
    fits = bench.fit_growth_exponents(df).set_index("form")
    assert math.isnan(fits.loc["naive", "exponent"]) and fits.loc["shared", "points"] == 3
    budget = bench.deepest_within_budget(df, 1e12).set_index("form")
    assert budget.loc["naive", "deepest_depth"] == 10
    assert not budget.loc["naive", "limited_by_sweep"]
