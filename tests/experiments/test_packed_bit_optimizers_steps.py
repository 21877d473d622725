"""Training-step times (paired spreads, per-round records) and the step fused into backward of the
packed-bit notebook (Memory Efficient Mixed Precision Optimizers, Lewandowski & Kosson)."""

import torch

from workbench.experiments.packed_bit_optimizers import (
    fused_backward,
    paired_ratio,
    round_times,
    rounds_ratio,
    step_time_by_format,
)
from workbench.models import MLP


def _mlp():
    return MLP(sizes=(128, 128, 128, 10), activation="relu")


def test_paired_ratio_and_its_saved_form():
    times = {"x": [1.0, 2.0, 4.0], "base": [2.0, 2.0, 6.0]}
    ratio, lo, hi = paired_ratio(times, "x", "base")
    assert (ratio, lo, hi) == (1.0, 1.0, 2.0)
    rounds = round_times(times)
    assert list(rounds.columns) == ["name", "round", "seconds"] and len(rounds) == 6
    # the rounds re-pair from the saved table exactly as from the dict, whatever the row order
    assert rounds_ratio(rounds.iloc[::-1], "x", "base") == (ratio, lo, hi)
    assert rounds_ratio(rounds, "x", "missing") is None


def test_step_times_pair_fused_with_per_parameter_and_carry_spreads():
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(4, 128, generator=gen), torch.randint(10, (4,), generator=gen))
    df = step_time_by_format(_mlp, batch, formats=["fp32", "amp", "fp16+8"], repeats=3, fused=True,
                             progress=False)
    assert list(df["format"]) == ["fp32", "amp", "fp16+8", "fp16+8 fused"]
    assert (df["speedup_vs_amp_lo"] <= df["speedup_vs_amp"] + 1e-12).all()
    assert (df["speedup_vs_amp"] <= df["speedup_vs_amp_hi"] + 1e-12).all()
    assert set(df.attrs["times"]) == set(df["format"])
    rounds = round_times(df.attrs["times"])
    assert set(rounds["name"]) == set(df["format"]) and set(rounds["round"]) == {0, 1, 2}


def test_fused_backward_reports_phase_and_time_spread():
    df = fused_backward(d_model=32, layers=1, vocab=50, batch=2, seq=4, steps=1, repeats=2, progress=False)
    assert list(df["step_in_backward"]) == [False, True]
    sib = df.iloc[1]
    assert sib["peak_bytes"] < df.iloc[0]["peak_bytes"] and sib["peak_phase"] in {"forward", "backward", "end"}
    assert sib["time_ratio_lo"] <= sib["time_ratio"] <= sib["time_ratio_hi"]
