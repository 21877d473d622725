"""The efficient DenseNet notebook's timing experiments: time per minibatch (Fig 5), the BN time share
(Section 4) and contiguous vs strided convolution (Fig 2 right)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import workbench.experiments.efficient_densenet as bench
import workbench.experiments.efficient_densenet.timing as timing


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
    # a difference of two forward times over a step time: noise can put a round anywhere, so no bound of 1
    assert row["bn_forward_share_min"] <= row["bn_forward_share"] <= row["bn_forward_share_max"]
    assert (df["forward_median_s"] > 0).all()
    assert (df[["kernel_s", "forward_kernel_s", "kernel_share", "forward_kernel_share"]] > 0).all().all()
    assert set(seen) == {"with BN", "without BN", ("forward", "with BN"), ("forward", "without BN")}
    models = {k: dict(zip(fn.__code__.co_freevars, fn.__closure__, strict=True))["m"].cell_contents
              for k, fn in seen.items()}
    count = {k: sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) for k, model in models.items()}
    assert count["without BN"] == 0 and count["with BN"] > 0
    assert models["forward", "with BN"] is models["with BN"] and models["forward", "without BN"] is models["without BN"]
    with pytest.raises(ValueError, match="rounds=0"):
        bench.bn_time_share(10, rounds=0)


def test_time_per_minibatch_pairs_ratios(one_thread) -> None:
    df = bench.time_per_minibatch(10, forms=("naive", "checkpoint", "shared"), growth_rate=4, batch_size=2,
                                  image_size=8, rounds=2, warmup=0, device="cpu", progress=False).set_index("form")
    assert df.loc["naive", "ratio_to_naive"] == 1.0
    for form in ("checkpoint", "shared"):
        r = df.loc[form]
        assert r["ratio_to_naive_min"] <= r["ratio_to_naive"] <= r["ratio_to_naive_max"]
    assert df.loc["checkpoint", "ratio_to_checkpoint"] == 1.0
    assert (df["median_s"] > 0).all() and (df["min_s"] <= df["max_s"]).all()
    # the device's operator time of one more step under the profiler, beside the wall time
    assert (df["kernel_s"] > 0).all() and (df["kernel_share"] == df["kernel_s"] / df["median_s"]).all()
    default = bench.time_per_minibatch(10, batch_size=2, image_size=8, rounds=1, warmup=0, device="cpu",
                                       progress=False)
    assert list(default["form"]) == ["naive", "checkpoint", "shared"]


def test_conv_contiguity_layouts(one_thread) -> None:
    df = bench.conv_contiguity((4, 8), batch_size=2, image_size=8, repeats=1, device="cpu", progress=False)
    assert set(df["layout"]) == {"contiguous", "non-contiguous"}
    assert (df[df["layout"] == "contiguous"]["ratio_to_contiguous"] == 1.0).all()
    assert all(len(r) == 1 for r in df["round_ratios"])
    assert (df["kernel_s"] > 0).all() and "kernel_share" in df
