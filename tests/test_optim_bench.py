"""Benchmark helpers of the packed-bit notebook: formats, analytic sizes, measured peaks (Memory Efficient
Mixed Precision Optimizers, Lewandowski & Kosson)."""

import pytest
import torch

from workbench.models import MLP
from workbench.experiments.packed_bit_optimizers import analytic_bytes_per_param, measure_peak, parse_format
from workbench.experiments.packed_bit_optimizers import addition_error, truncate_to_e5m2
from workbench.optim.update import CHUNK


def test_parse_format_and_bad_names():
    f = parse_format("fp16+13 SR")
    assert (f.param_dtype, f.extra_bits, f.stochastic_rounding) == (torch.float16, 13, True)
    assert parse_format("amp").autocast == torch.float16 and not parse_format("bf16").packed
    for bad in ("fp32+8", "int8", "fp16+x", "bf16 SR"):
        with pytest.raises(ValueError, match="not understood|fp16/bf16 only"):
            parse_format(bad)


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


def test_e5m2_truncation_and_addition_error_shape():
    x = torch.tensor([1.0, 1.2, -3.7, 65504.0]).half()
    t = truncate_to_e5m2(x)
    torch.testing.assert_close(t.float(), torch.tensor([1.0, 1.0, -3.5, 57344.0]))
    df = addition_error(sizes=[100], n_ops=[1, 50], width=256)
    assert set(df["format"]) == {"fp16", "fp16+8", "fp16+8 SR"} and (df["rel_error"] >= 0).all()
    many = df[(df["panel"] == "many ops") & (df["ops"] == 50)].set_index("format")["rel_error"]
    assert many["fp16+8"] < many["fp16"]  # extra bits stop the error from accumulating
