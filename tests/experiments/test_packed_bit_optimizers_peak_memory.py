"""Formats, analytic sizes and measured peaks of the packed-bit notebook (Memory Efficient Mixed Precision
Optimizers, Lewandowski & Kosson): state inside the memory peak, where the peak falls, memory over the
steps by category, the saving ceiling and row lookups."""

import pandas as pd
import pytest
import torch

from workbench.experiments.packed_bit_optimizers import (
    analytic_bytes_per_param,
    find_row,
    make_optimizer,
    measure_peak,
    parse_format,
    saving_ceiling,
    step_timeline,
)
from workbench.models import MLP
from workbench.optim import PackedSGD
from workbench.optim.update import CHUNK


def _mlp():
    return MLP(sizes=(128, 128, 128, 10), activation="relu")


def _batches(n=2, batch=2, width=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, width, generator=gen), torch.randint(10, (batch,), generator=gen)) for _ in range(n)]


def test_parse_format_and_bad_names():
    f = parse_format("fp16+13 SR")
    assert (f.param_dtype, f.extra_bits, f.stochastic_rounding) == (torch.float16, 13, True)
    assert parse_format("amp").autocast == torch.float16 and not parse_format("bf16").packed
    for bad in ("fp32+8", "int8", "fp16+x", "bf16 SR", "fp16 nearest", "fp32+8 nearest", "fp16+8 SR nearest"):
        with pytest.raises(ValueError, match="not understood|fp16/bf16 only"):
            parse_format(bad)


def test_a_nearest_format_steps_as_the_optimizer_with_master_rounding_nearest():
    fmt = parse_format("fp16+8 nearest")
    assert (fmt.extra_bits, fmt.stochastic_rounding, fmt.master_rounding) == (8, False, "nearest")
    assert parse_format("bf16+8 nearest bf16 states").master_rounding == "nearest"
    assert parse_format("fp16+8").master_rounding == "truncate"
    torch.manual_seed(0)
    weights = torch.randn(64, 8).half()
    made = make_optimizer([w := weights.clone().requires_grad_()], fmt, optimizer="sgd", lr=1e-3)
    direct = PackedSGD([v := weights.clone().requires_grad_()], lr=1e-3, momentum=0.9, extra_bits=8,
                       master_rounding="nearest")
    for opt, p in ((made, w), (direct, v)):
        for _ in range(3):
            p.grad = torch.linspace(-1, 1, p.numel()).view_as(p).half()
            opt.step()
    torch.testing.assert_close(w, v, rtol=0, atol=0)
    assert made.param_groups[0]["master_rounding"] == "nearest"


def test_analytic_bytes_per_param():
    assert analytic_bytes_per_param(parse_format("fp32")) == 12
    assert analytic_bytes_per_param(parse_format("amp")) == 14
    assert analytic_bytes_per_param(parse_format("fp16+8"), in_backward=True) == 2 + 4 + 1
    assert analytic_bytes_per_param(parse_format("bf16+16"), optimizer="adamw") == 2 + 2 + 8 + 2


def test_measured_peak_matches_analytic_and_step_in_backward_saves_gradients():
    torch.manual_seed(0)
    batches = [(torch.randn(2, 256), torch.randint(10, (2,))) for _ in range(2)]

    def model_fn():
        return MLP(sizes=(256, 256, 256, 256, 10), activation="relu")

    recs = {(f, s): measure_peak(model_fn, parse_format(f), batches, in_backward=s)
            for f in ("fp32", "fp16+8") for s in (False, True)}
    fp32 = recs[("fp32", False)]
    # tiny activations: the measured peak is parameters + gradients + momentum
    assert abs(fp32["peak_bytes_per_param"] - 12) < 0.3
    for f in ("fp32", "fp16+8"):
        assert recs[(f, True)]["peak_bytes"] < recs[(f, False)]["peak_bytes"]
    # the eager packed step adds bounded temporaries: at most ~64 B per value of one chunk
    packed = recs[("fp16+8", True)]
    overhead = packed["peak_bytes"] - packed["analytic_bytes_per_param"] * packed["params"]
    assert 0 < overhead < 64 * CHUNK + 256 * 256 * 2 + 2**16


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


def test_state_dtype_only_for_packed_formats():
    p = [torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)]
    with pytest.raises(ValueError, match="packed formats"):
        make_optimizer(p, parse_format("bf16"), optimizer="adamw", lr=1e-3, state_dtype=torch.bfloat16)


def test_find_row_and_saving_ceiling():
    df = pd.DataFrame({"format": ["amp", "amp", "fp16+8"], "step_in_backward": [False, True, True],
                       "peak_bytes_per_param": [14.0, 12.0, 8.0]})
    assert find_row(df, format="amp", step_in_backward=True)["peak_bytes_per_param"] == 12.0
    assert find_row(df, format="fp32") is None and find_row(None, format="amp") is None
    assert find_row(df, missing_column=1) is None
    # fp16+8 in backward with SGD: 2 + 4 + 1 = 7 B/param at best, against AMP's measured 14: half saved
    assert saving_ceiling(df, optimizer="sgd") == pytest.approx(0.5)
    assert saving_ceiling(df[df["format"] != "amp"]) != saving_ceiling(df[df["format"] != "amp"])  # NaN
