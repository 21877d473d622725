"""The packed-bit notebook's measurements: state inside the memory peak, where the peak falls, memory
over the steps by category, fp8+k emulation, paired spreads, accuracy over seeds and the
side-by-side table (Memory Efficient Mixed Precision Optimizers, Lewandowski & Kosson)."""

import importlib

import pandas as pd
import pytest
import torch

from workbench.data import synthetic_images
from workbench.experiments.packed_bit_optimizers import (
    accuracy_by_format,
    fp8_extra_bits,
    fused_backward,
    make_optimizer,
    measure_peak,
    paired_gap,
    paired_ratio,
    parse_format,
    peer_methods,
    peer_table,
    step_time_by_format,
    step_timeline,
    truncate_significand,
    truncate_to_e5m2,
)
from workbench.experiments.packed_bit_optimizers import peers as peers_module
from workbench.models import MLP


def _mlp():
    return MLP(sizes=(128, 128, 128, 10), activation="relu")


def _batches(n=2, batch=2, width=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, width, generator=gen), torch.randint(10, (batch,), generator=gen)) for _ in range(n)]


def test_peak_includes_optimizer_state_and_says_where_it_falls():
    torch.manual_seed(0)
    rec = measure_peak(_mlp, parse_format("fp32"), _batches(), in_backward=False)
    param_bytes = 4 * rec["params"]
    # the peak falls in the second step: the momentum (4 B/param) exists, gradients are being accumulated
    assert rec["peak_optimizer_state"] == param_bytes and 0 < rec["peak_gradients"] <= param_bytes
    parts = param_bytes + rec["peak_gradients"] + rec["peak_optimizer_state"] + rec["peak_activations_temporaries"]
    assert parts == rec["peak_bytes"] and rec["peak_bytes"] >= 2.5 * param_bytes
    assert rec["peak_phase"] in {"forward", "backward", "step", "end"} and rec["peak_step"] in (1, 2)
    sib = measure_peak(_mlp, parse_format("fp32"), _batches(), in_backward=True)
    assert sib["peak_gradients"] < param_bytes and "step" != sib["peak_phase"]


def test_accuracy_memory_counts_the_state_it_used_to_miss():
    data = synthetic_images(64, shape=(1, 4, 4), num_classes=3, seed=0)
    train_set, test_set = data.split(0.25, seed=0)

    def model_fn():
        return MLP(sizes=(16, 64, 64, 3), activation="relu")

    df = accuracy_by_format(model_fn, train_set, test_set, formats=["fp32"], epochs=1, lr=0.01, batch_size=8,
                            seeds=[0, 1], progress=False)
    assert list(df["seed"]) == [0, 1] and df["peak_bytes"].iloc[1] != df["peak_bytes"].iloc[1]  # NaN: first seed only
    params = int(df["params"].iloc[0])
    # parameters + gradients + SGD momentum = 12 B/param at least (it measured about 8 before)
    assert df["peak_bytes"].iloc[0] >= 12 * params


def test_timeline_categories_add_up_and_phases_follow_the_step():
    tl = step_timeline(_mlp, _batches(n=2), formats=[("fp32", False), ("fp16+8", True)])
    parts = tl[["parameters", "gradients", "optimizer_state", "activations_temporaries"]].sum(axis=1)
    torch.testing.assert_close(torch.tensor(parts.to_numpy()), torch.tensor(tl["total"].to_numpy()), rtol=0, atol=0)
    ordinary = tl[tl["format"] == "fp32"]
    assert list(dict.fromkeys(ordinary["phase"])) == ["forward", "backward", "step", "end"]
    assert "step" not in set(tl[tl["format"] == "fp16+8"]["phase"])
    assert set(tl["step"]) == {1, 2}
    # state appears at the first step and stays
    assert ordinary[ordinary["phase"] == "forward"]["optimizer_state"].iloc[0] == 0
    assert ordinary[(ordinary["step"] == 2)]["optimizer_state"].min() > 0


def test_fp8_emulation_keeps_k_more_bits():
    x = torch.tensor([1.0, 1.2, -3.7, 65504.0, 1e-3]).half()
    torch.testing.assert_close(truncate_significand(x, 10), x)
    torch.testing.assert_close(truncate_significand(x, 2), truncate_to_e5m2(x))
    six = truncate_significand(x, 6).float()
    assert ((six - x.float()).abs() <= (truncate_to_e5m2(x).float() - x.float()).abs()).all()
    assert (fp8_extra_bits("fp8"), fp8_extra_bits("fp8+4"), fp8_extra_bits("fp16+8")) == (0, 4, None)
    with pytest.raises(ValueError, match="0..8"):
        fp8_extra_bits("fp8+9")
    with pytest.raises(ValueError, match="0..10"):
        truncate_significand(x, 11)
    with pytest.raises(TypeError, match="float16"):
        truncate_significand(x.float(), 2)


def test_paired_gap_and_ratio():
    df = pd.DataFrame({"regime": "r", "seed": [0, 0, 1, 1], "format": ["a", "b", "a", "b"],
                       "test_acc": [0.90, 0.85, 0.80, 0.82]})
    mean, lo, hi = paired_gap(df, "r", "a", "b")
    torch.testing.assert_close(torch.tensor([mean, lo, hi]), torch.tensor([1.5, -2.0, 5.0]), rtol=0, atol=1e-9)
    assert paired_gap(df, "r", "a", "b", absolute=True)[1] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="no format"):
        paired_gap(df, "r", "a", "c")
    times = {"x": [1.0, 2.0, 4.0], "base": [2.0, 2.0, 6.0]}
    ratio, lo, hi = paired_ratio(times, "x", "base")
    assert (ratio, lo, hi) == (1.0, 1.0, 2.0)


def test_step_times_pair_fused_with_per_parameter_and_carry_spreads():
    batch = _batches(n=1, batch=4)[0]
    df = step_time_by_format(_mlp, batch, formats=["fp32", "amp", "fp16+8"], repeats=3, fused=True,
                             progress=False)
    assert list(df["format"]) == ["fp32", "amp", "fp16+8", "fp16+8 fused"]
    assert (df["speedup_vs_amp_lo"] <= df["speedup_vs_amp"] + 1e-12).all()
    assert (df["speedup_vs_amp"] <= df["speedup_vs_amp_hi"] + 1e-12).all()
    assert set(df.attrs["times"]) == set(df["format"])


def test_fused_backward_reports_phase_and_time_spread():
    df = fused_backward(d_model=32, layers=1, vocab=50, batch=2, seq=4, steps=1, repeats=2, progress=False)
    assert list(df["step_in_backward"]) == [False, True]
    sib = df.iloc[1]
    assert sib["peak_bytes"] < df.iloc[0]["peak_bytes"] and sib["peak_phase"] in {"forward", "backward", "end"}
    assert sib["time_ratio_lo"] <= sib["time_ratio"] <= sib["time_ratio_hi"]


def test_state_dtype_only_for_packed_formats():
    p = [torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)]
    with pytest.raises(ValueError, match="packed formats"):
        make_optimizer(p, parse_format("bf16"), optimizer="adamw", lr=1e-3, state_dtype=torch.bfloat16)


def test_peer_methods_parse_and_reject():
    assert peer_methods("all")[0] == "torch fp32" and "ours bf16+16 (bf16 states)" in peer_methods("all")
    assert peer_methods("torch bf16, ours bf16+8 (fp32 states)") == ["torch bf16", "ours bf16+8 (fp32 states)"]
    with pytest.raises(ValueError, match="unknown method"):
        peer_methods("torch fp64")


def test_peer_table_bytes_and_missing_peers(monkeypatch):
    real_import = importlib.import_module

    def no_optimi(name, *args):
        if name == "optimi":
            raise ImportError("No module named 'optimi'")
        return real_import(name, *args)

    monkeypatch.setattr(peers_module.importlib, "import_module", no_optimi)
    monkeypatch.setattr("workbench.experiments.packed_bit_optimizers.bench.packed_option_available",
                        lambda option: False)
    data = synthetic_images(48, shape=(1, 4, 4), num_classes=3, seed=0)
    train_set, test_set = data.split(0.25, seed=0)

    def model_fn():
        return MLP(sizes=(16, 32, 3), activation="relu")

    methods = ["torch fp32", "torch bf16", "optimi bf16 + Kahan", "ours bf16+8 (fp32 states)",
               "ours bf16+8 (bf16 states)"]
    df = peer_table(model_fn, train_set, test_set, methods=methods, epochs=1, batch_size=8, seeds=[0, 1],
                    repeats=2, progress=False).set_index("method")
    assert not df.loc["optimi bf16 + Kahan", "available"]
    assert "not installed" in df.loc["optimi bf16 + Kahan", "note"]
    assert not df.loc["ours bf16+8 (bf16 states)", "available"]
    assert "not available in this build" in df.loc["ours bf16+8 (bf16 states)", "note"]
    params = int(df.loc["torch fp32", "params"])
    # AdamW: weights + grads + two moments (+ a 4-byte step counter per tensor)
    got = torch.tensor(df.loc[["torch fp32", "torch bf16"], "bytes_per_param"].to_numpy(dtype=float))
    torch.testing.assert_close(got, torch.tensor([16.0, 8.0], dtype=torch.float64), atol=4 * 4 / params * 4, rtol=0)
    ours = df.loc["ours bf16+8 (fp32 states)"]
    assert 13.0 <= ours["bytes_per_param"] < 13.0 + 13.0 * 31 * 4 / params  # 32-value alignment padding
    assert df.loc["torch fp32", "speed_vs_torch_fp32"] == 1.0 and df.loc["torch fp32", "seeds"] == 2
    assert df.loc[df["available"], "acc_mean"].between(0, 100).all()
