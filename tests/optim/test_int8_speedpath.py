"""The C++ kernel's codes without the divider (``csrc/packed_int8.h``: ``fast_codes``) against the eager step.

Where a group's scale is a normal number in [2**-60, 2**60] the AVX512 build computes a code from an approximate
square root and takes the exact path only for a vector with a lane within 2**-12 of a half-integer (a tie of the
rounding). These tests put values on and near every tie: every bf16 magnitude (and sign) below scales of every
bf16 mantissa, stepped as SGD momentum's first buffer (the gradient itself, quantized), and many random AdamW
moments, whose ~2**-11 of lanes near a tie take the exact path. Bit for bit against ``quantized.quantize``.
"""

import pytest
import torch
from kernel_cases import BF16, KEY, assert_same_bits, coef_for

from workbench.optim import cpu_kernel
from workbench.optim.quantized import GROUP, new_quantized
from workbench.optim.update import adam_math, chunked_update, sgd_math


@pytest.fixture(scope="module")
def kernel():
    if not cpu_kernel.available():
        pytest.skip(f"the C++ kernel could not be built here: {cpu_kernel._STATE['error']}")


def _every_bf16_below_each_scale() -> torch.Tensor:
    """Groups of 32: lane 0 the scale (each bf16 mantissa, three exponents), then every bf16 magnitude in
    [s * 2**-17, s] with alternating signs, padded with the scale."""
    rows = []
    for exponent in (0, -20, 37):
        for mantissa in range(128):
            s = torch.tensor([(127 + exponent) << 7 | mantissa], dtype=torch.int16).view(torch.bfloat16).float()
            lo = (s * 2.0**-17).bfloat16().view(torch.int16).item()
            hi = s.bfloat16().view(torch.int16).item()
            mags = torch.arange(lo, hi + 1, dtype=torch.int16).view(torch.bfloat16).float()
            signs = torch.ones_like(mags)
            signs[1::2] = -1.0
            body = mags * signs
            per = GROUP - 1
            body = torch.cat([body, s.repeat((-body.numel()) % per)]).view(-1, per)
            rows.append(torch.cat([s.expand(body.shape[0], 1), body], dim=1))
    return torch.cat(rows).flatten()


def _run(n, math_fn, options, grad, coef, states, half, planes, *, steps=1):
    static = dict(math_fn=math_fn, extra_bits=8, stochastic_rounding=False, master_rounding="truncate",
                  options=options, quantized=("signed", "square") if math_fn is adam_math else ("signed",))
    runs = [[half.clone(), [p.clone() for p in planes], [t.clone() for t in states]] for _ in range(2)]
    for step in range(steps):
        c = coef(step)
        chunked_update(runs[0][0], grad, runs[0][1], runs[0][2], c, KEY + step, bits=8, **static)
        cpu_kernel.packed_update_cpu(runs[1][0], grad, runs[1][1], runs[1][2], c, KEY + step, **static)
    assert_same_bits([runs[0][0], *runs[0][1], *runs[0][2]], [runs[1][0], *runs[1][1], *runs[1][2]])


def test_every_bf16_value_below_every_scale_mantissa(kernel):
    grad = _every_bf16_below_each_scale().to(BF16)
    n = grad.numel()
    half = torch.full((n,), 0.5, dtype=BF16)
    planes = [torch.zeros(n, dtype=torch.uint8)]
    st = new_quantized(n, "exp_avg", torch.empty(0))
    coef = lambda step: torch.tensor([1e-2, 0.0, 0.9, 0.95])  # noqa: E731  no weight decay: the buffer is the gradient
    _run(n, sgd_math, {"momentum": True, "nesterov": False, "first": True}, grad, coef, list(st.values()), half,
         planes)


def test_random_adamw_moments_near_ties(kernel):
    n = 1 << 18
    g = torch.Generator().manual_seed(46)
    half = (torch.randn(n, generator=g) * 0.02).to(BF16)
    grad = (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))).to(BF16)
    planes = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)]
    states = [t for key in ("exp_avg", "exp_avg_sq") for t in new_quantized(n, key, torch.empty(0)).values()]
    _run(n, adam_math, {"decoupled": True}, grad, lambda step: coef_for(adam_math, step=step + 1), states, half,
         planes, steps=4)
