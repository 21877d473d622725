"""``master_rounding="nearest"``: the 16-bit value rounded to nearest, the extra bits its signed remainder (issue 46).

Tests ``split_merge`` (the encoding: truncate's master value bit for bit, the 16-bit value within half an ulp,
every special pattern), the optimizers' option (the master rounded to nearest at its lowest kept bit, refused
with stochastic rounding), the C++ CPU kernel, the compiled step and the Triton kernel (through its interpreter)
against the eager step bit for bit, and the measured effect: the master value closer to fp32 AdamW's than with
truncation.
"""

import math

import pytest
import torch
from kernel_cases import BF16, FORMATS, FP16, KEY, MATHS, NO_PLANES, assert_same_bits, coef_for, fmt_id, inputs

from workbench.optim import PackedAdamW, PackedSGD, cpu_kernel, triton_kernel
from workbench.optim.formats import FORMATS as WIDTHS
from workbench.optim.formats import storage_bits
from workbench.optim.split_merge import merge, merge_values, split, split_values
from workbench.optim.update import adam_math, chunked_update

KS = {BF16: (0, 1, 3, 8, 15, 16), FP16: (0, 1, 5, 8, 12, 13)}
CASES = [(dtype, k) for dtype in (BF16, FP16) for k in KS[dtype]]


def _case_id(case):
    return f"{'bf16' if case[0] == BF16 else 'fp16'}+{case[1]}"


def _patterns(dtype, n=1 << 16, seed=0):
    """fp32 values: random bit patterns, and ones built around ``dtype``'s special 16-bit values (zeros,
    subnormals, the largest finite, inf, NaN, all-ones low bits) with every kind of remainder below them."""
    g = torch.Generator().manual_seed(seed)
    rnd = torch.randint(-(2**31), 2**31, (n,), dtype=torch.int64, generator=g).to(torch.int32)
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 1e-40, -1e-40, 1e-45, 3.4e38, -3.4e38,
                            3.3895e38, 65504.0, -65504.0, 65519.0, 65520.0, 65535.9, 70000.0, 6e-8, 2.0**-14, 2.0**-24,
                            1.0, -1.0, 1.5, 1 + 2.0**-8, 2.0 - 2.0**-23, -(2.0 - 2.0**-23)]).view(torch.int32)
    half = torch.tensor([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x7BFF, 0xFBFF,
                         0x7F80, 0x7C00, 0x7F81, 0x7C01, 0x7FFF, 0xFFFF, 0x3FFF, 0x3BFF, 0x3F7F], dtype=torch.int32)
    if dtype == BF16:  # 16-bit pattern on top, every remainder shape below it
        lows = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x7F00, 0x80FF, 0xC000, 0x4000], dtype=torch.int32)
        built = ((half[:, None] << 16) | lows[None, :]).flatten()
    else:  # fp16: values just below, at and above each 16-bit value's grid points
        h = half.to(torch.int16).view(FP16).float()
        h = h[h.isfinite()]
        steps = torch.tensor([0.0, 0.25, 0.5, 0.5 - 2.0**-12, 0.5 + 2.0**-12, 0.75, 1 - 2.0**-13])
        ulp = torch.where(h.abs() < 2.0**-14, torch.full_like(h, 2.0**-24),
                          2.0 ** (torch.floor(torch.log2(h.abs().clamp_min(2.0**-14))) - 10))
        built = (h[:, None] + torch.sign(h)[:, None] * steps[None, :] * ulp[:, None]).flatten()
        built = built.view(torch.int32)
    return torch.cat([rnd, special, built]).view(torch.float32)


def _bits(t):
    size = t.element_size()
    return t.view({2: torch.int16, 4: torch.int32}[size]).to(torch.int64) & (2 ** (8 * size) - 1)


def _ulp(half):
    """The distance to the next 16-bit value away from zero (past the largest finite value: the grid's step)."""
    nxt = _next_away(half)
    prev = (_bits(half) - 1).to(torch.int32).to(torch.int16).view(half.dtype).double()
    return torch.where(nxt.isinf(), (half.double() - prev).abs(), (nxt - half.double()).abs())


def _next_away(half):
    """The next 16-bit value away from zero (as fp64)."""
    return (_bits(half) + 1).to(torch.int32).to(torch.int16).view(half.dtype).double()


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_split_values_nearest_keeps_truncates_master_and_rounds_the_half(case):
    dtype, k = case
    x = _patterns(dtype)
    h_t, v_t = split_values(x, dtype=dtype, extra_bits=k)
    h_n, v_n = split_values(x, dtype=dtype, extra_bits=k, nearest=True)
    assert torch.equal(v_n, v_t), "the extra bits are truncate's"
    m_t = merge_values(h_t, v_t, extra_bits=k)
    m_n = merge_values(h_n, v_n, extra_bits=k, nearest=True)
    if k:
        want = _bits(m_t)
        if dtype == BF16 and k == 16:  # a NaN comes back quiet (as below 16 extra bits; the step's NaNs are)
            want = torch.where(m_t.isnan(), want | 0x400000, want)
        assert torch.equal(_bits(m_n), want), "the master value is truncate's, bit for bit"
    else:  # no extra bit: the master is the 16-bit value, rounded to nearest (checked below)
        assert torch.equal(_bits(m_n), _bits(h_n.float()))
    # the 16-bit value: the truncation or the next value away from zero, whichever is nearer the master
    finite = h_t.isfinite() & ~x.isnan()
    if dtype == FP16:  # |x| >= 2**16 truncates to 65504 + all-ones extra bits: seen as inf (IEEE overflow)
        big = x.isfinite() & (x.abs() >= 2.0**16)
        assert bool(h_n[big].isinf().all())
        finite &= ~big
    assert torch.equal(h_n.isnan(), x.isnan()), "a NaN is seen as a NaN, a number as a number"
    inf = h_t.isinf() & ~x.isnan()
    assert torch.equal(_bits(h_n)[inf], _bits(h_t)[inf]), "inf is never rounded"
    if not (dtype == BF16 and k == 16):
        assert torch.equal(_bits(h_n)[x.isnan()], _bits(h_t)[x.isnan()]), "a NaN is never rounded"
    lo, m = h_t.double()[finite], m_t.double()[finite]
    up = _bits(h_n)[finite] != _bits(h_t)[finite]
    assert torch.equal(_bits(h_n)[finite][up], (_bits(h_t)[finite][up] + 1) & 0xFFFF), "one step away from zero"
    ulp = _ulp(h_t)[finite]
    if k == 0:  # the master is x: the 16-bit value is x rounded to nearest
        m = x.double()[finite]
    seen = torch.where(up, lo + torch.sign(lo) * ulp, lo)  # the largest finite value rounds to inf: its grid point
    seen = torch.where((lo == 0) & up, _next_away(h_t)[finite], seen)
    err, remainder = (seen - m).abs(), (m - lo).abs()
    assert bool((err <= ulp / 2).all()), f"max error {(err / ulp).max().item():.3f} ulps"
    assert bool((up == (remainder >= ulp / 2)).all()), "rounded up exactly when at least half an ulp remains"
    tie = remainder == ulp / 2
    # where it is not a tie, torch's own round to nearest of the master gives the same 16-bit value
    nt = ~tie
    master = (m_t if k else x)[finite][nt]
    near = master.to(dtype)
    overflow = near.isinf() & ~h_n[finite][nt].isinf()  # fp16: x >= 2**16 truncates to 65504 first (k = 0)
    assert torch.equal(_bits(h_n[finite][nt][~overflow]), _bits(near[~overflow]))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_split_nearest_halves_the_master_error(case):
    dtype, k = case
    x = _patterns(dtype)
    x = x[x.isfinite() & (x.abs() >= 2.0**-14) & (x.abs() < (2.0**16 if dtype == FP16 else 2.0**127))]
    p = {BF16: 7, FP16: 10}[dtype]
    h, e = split(x, dtype=dtype, extra_bits=k, master_rounding="nearest")
    m = merge(h, e, extra_bits=k, master_rounding="nearest")
    h_t, e_t = split(x, dtype=dtype, extra_bits=k)
    m_t = merge(h_t, e_t, extra_bits=k)
    rel = ((m.double() - x.double()) / x.double()).abs()
    rel_t = ((m_t.double() - x.double()) / x.double()).abs()
    assert rel.max().item() <= 2.0 ** -(p + k + 1), "half of truncate's bound 2**-(p + k)"
    if k <= WIDTHS[dtype][0] - 4:  # >= 4 dropped bits: truncation's mean error is about twice nearest's
        assert rel.mean().item() < 0.6 * rel_t.mean().item(), (rel.mean().item(), rel_t.mean().item())
    # the 16-bit value: nearest to the master (within half an ulp) as above
    below = split_values(m, dtype=dtype, extra_bits=k)[0]  # the master's own 16-bit truncation
    inf = h.isinf()  # IEEE overflow: at least half an ulp past the largest finite value
    assert ((h.double() - m.double()).abs() <= _ulp(below) / 2)[~inf].all()
    assert (m[inf].double().abs() >= torch.finfo(dtype).max + _ulp(below[inf]) / 2).all()
    if k == 0:  # nothing kept below the 16-bit value: it is x rounded to nearest
        tie = ((x.double() - h_t.double()).abs() == _ulp(h_t) / 2)
        near = x.to(dtype)
        keep = ~tie & ~near.isinf()  # a finite value never rounds to inf there (65520 <= |x| < 2**16: 65504)
        assert torch.equal(_bits(h[keep]), _bits(near[keep]))
        assert bool((h[near.isinf()].abs() == torch.finfo(dtype).max).all())


def test_nearest_with_stochastic_rounding_is_refused():
    p = [torch.nn.Parameter(torch.zeros(4, dtype=BF16))]
    for make in (PackedAdamW, PackedSGD):
        with pytest.raises(ValueError, match="master_rounding='nearest' and stochastic_rounding=True"):
            make(p, lr=1e-3, extra_bits=7, stochastic_rounding=True, master_rounding="nearest")
    with pytest.raises(ValueError, match="master_rounding='nearest' and stochastic_rounding=True"):
        split(torch.zeros(4), dtype=BF16, extra_bits=7, stochastic_rounding=True, master_rounding="nearest")
    opt = PackedAdamW(p, lr=1e-3, extra_bits=7, master_rounding="nearest")
    opt.param_groups[0]["stochastic_rounding"] = True  # edited by hand: checked again at the step
    p[0].grad = torch.ones(4, dtype=BF16)
    with pytest.raises(ValueError, match="master_rounding='nearest' and stochastic_rounding=True"):
        opt.step()


# ---------------------------------------------------------------------------------------- the kernels
NEAREST_FORMATS = [f for f in FORMATS + NO_PLANES if not f[2]]  # byte planes without stochastic rounding


def _kernel_compare(run_kernel, n, fmt, state_dtype, math_fn, options, *, steps=2, garbage=False, seed=0):
    """(eager, kernel) after ``steps`` steps from the same inputs (half, byte planes, states), and the gradient;
    k = 0: no plane."""
    dtype, k, sr = fmt
    g = torch.Generator().manual_seed(seed)
    n_states = 2 if math_fn is adam_math else int(options["momentum"])
    half, grad, planes, states = inputs(n, dtype, k, sr, state_dtype, n_states, g, garbage=garbage)
    static = dict(math_fn=math_fn, extra_bits=k, stochastic_rounding=sr, master_rounding="nearest", options=options)
    bits = storage_bits(k, sr)
    runs = [[half.clone(), [p.clone() for p in planes], [s.clone() for s in states]] for _ in range(2)]
    for step in range(steps):
        coef = coef_for(math_fn, step=(1, 1000, 3)[step % 3])
        for j, (h, pl, st) in enumerate(runs):
            extra = pl if bits else torch.zeros(0, dtype=torch.int32)
            if j == 0:
                chunked_update(h, grad, extra, st, coef, KEY + step, bits=bits, **static)
            else:
                run_kernel(h, grad, extra, st, coef, KEY + step, **static)
    return [[h, *pl, *st] for h, pl, st in runs], grad


@pytest.fixture(scope="module")
def cpu_built():
    if not cpu_kernel.available():
        pytest.skip(f"the C++ kernel could not be built here: {cpu_kernel._STATE['error']}")


@pytest.mark.parametrize("fmt", NEAREST_FORMATS, ids=fmt_id)
def test_cpu_kernel_equals_the_eager_step(cpu_built, fmt, one_thread):
    from kernel_cases import widened_apart

    for state_dtype in (torch.float32, BF16):
        for math_fn, options in MATHS:
            for garbage in (False, True):
                (eager, kernel), grad = _kernel_compare(cpu_kernel.packed_update_cpu, 2053 if garbage else 4133, fmt,
                                                        state_dtype, math_fn, options, garbage=garbage,
                                                        steps=1 if garbage else 3, seed=int(garbage))
                assert_same_bits(eager, kernel, nan_at=widened_apart(grad))


@pytest.mark.skipif(not triton_kernel.available(), reason="needs triton (pip install triton)")
@pytest.mark.parametrize("fmt", [(BF16, 8, False), (BF16, 16, False), (FP16, 8, False), (BF16, 0, False),
                                 (BF16, 12, False), (FP16, 13, False), (FP16, 3, False)], ids=fmt_id)
def test_triton_kernel_interpreted_equals_the_eager_step(fmt):
    """Through Triton's interpreter on CPU tensors (no GPU here): byte planes, k = 0 and dense words."""
    from test_triton_kernel import _assert_same_numbers, _flat

    dtype, k, sr = fmt
    bits = storage_bits(k, sr)
    for math_fn, options in (MATHS[0], MATHS[2]):
        for garbage in (False, True):
            g = torch.Generator().manual_seed(int(garbage))
            n_states = 2 if math_fn is adam_math else 1
            half, grad, planes, states = inputs(300, dtype, k, sr, torch.float32, n_states, g, garbage=garbage)
            static = dict(math_fn=math_fn, extra_bits=k, stochastic_rounding=sr, master_rounding="nearest",
                          options=options)
            runs = []
            for j in range(2):
                extra = (torch.zeros(0, dtype=torch.int32) if bits == 0 else planes.clone()
                         if planes.dtype == torch.int32 else [p.clone() for p in planes])
                run = [half.clone(), extra, [s.clone() for s in states]]
                for step in range(1 if garbage else 2):
                    coef = coef_for(math_fn, step=(1, 1000)[step])
                    if j == 0:
                        chunked_update(run[0], grad, run[1], run[2], coef, KEY + step, bits=bits, **static)
                    else:
                        triton_kernel.packed_update_triton(run[0], grad, run[1], run[2], coef, KEY + step, **static)
                runs.append(_flat(run, bits, 300))
            _assert_same_numbers(*runs)


# ------------------------------------------------------------------------------------- the optimizers
def _model(seed, dtype):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    with torch.no_grad():  # every run starts from the same 16-bit values
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    return model


def _train(model, opt, steps, dtype=None):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(256, 32, generator=g), torch.randn(256, 4, generator=g)
    for _ in range(steps):
        opt.zero_grad()
        ((model(x if dtype is None else x.to(dtype)).float() - y) ** 2).mean().backward()
        opt.step()


@pytest.mark.parametrize("make, kw", [(PackedAdamW, dict(lr=1e-2, weight_decay=1e-2)),
                                      (PackedSGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3))],
                         ids=["PackedAdamW", "PackedSGD"])
@pytest.mark.parametrize("dtype, k", [(BF16, 8), (BF16, 16), (FP16, 8), (BF16, 0)], ids=["bf16+8", "bf16+16", "fp16+8",
                                                                                        "bf16+0"])
def test_optimizer_steps_equal_on_the_cpu_kernel_and_eagerly(cpu_built, monkeypatch, make, kw, dtype, k):
    launches = []
    launch = cpu_kernel._launch
    monkeypatch.setattr(cpu_kernel, "_launch", lambda *a: launches.append(1) or launch(*a))
    models = [_model(0, dtype).to(dtype) for _ in range(2)]
    opts = [make(models[0].parameters(), extra_bits=k, master_rounding="nearest", fused=True, **kw),
            make(models[1].parameters(), extra_bits=k, master_rounding="nearest", compile=False, **kw)]
    for m, o in zip(models, opts, strict=True):
        _train(m, o, 4, dtype)
    assert launches, "the fused step ran the C++ kernel"
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))
        assert torch.equal(opts[0].master_weight(p).view(torch.int32), opts[1].master_weight(q).view(torch.int32))


@pytest.mark.parametrize("dtype, k", [(BF16, 4), (FP16, 8)], ids=["bf16+4 dense words", "fp16+8"])
def test_compiled_step_equals_the_eager_step(dtype, k):
    models = [_model(0, dtype).to(dtype) for _ in range(2)]
    opts = [PackedAdamW(models[0].parameters(), lr=1e-2, extra_bits=k, master_rounding="nearest", fused=True,
                        compile=True),
            PackedAdamW(models[1].parameters(), lr=1e-2, extra_bits=k, master_rounding="nearest", compile=False)]
    for m, o in zip(models, opts, strict=True):
        _train(m, o, 3, dtype)
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))
        assert torch.equal(opts[0].master_weight(p).view(torch.int32), opts[1].master_weight(q).view(torch.int32))


def test_nearest_keeps_the_master_closer_to_fp32_adamw_than_truncate():
    """bf16+4, 150 AdamW steps of a small MLP: the mean |master - fp32 AdamW's weight| and the same for the
    16-bit weights the model sees, truncate against nearest, in one run."""
    steps, k = 150, 4
    ref = _model(0, BF16)
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), steps)
    err = {}
    for mode in ("truncate", "nearest"):
        model = _model(0, BF16).to(BF16)
        opt = PackedAdamW(model.parameters(), lr=1e-3, extra_bits=k, master_rounding=mode)
        _train(model, opt, steps, BF16)
        n = sum(p.numel() for p in model.parameters())
        err[mode] = [sum((w(p).double() - r.detach().double()).abs().sum().item()
                         for p, r in zip(model.parameters(), ref.parameters(), strict=True)) / n
                     for w in (opt.master_weight, lambda p: p.detach())]
    figures = (f"mean |master - fp32 AdamW|: truncate {err['truncate'][0]:.3e}, nearest {err['nearest'][0]:.3e}; "
               f"16-bit weights: truncate {err['truncate'][1]:.3e}, nearest {err['nearest'][1]:.3e}")
    print(figures)
    assert err["nearest"][0] < 0.7 * err["truncate"][0], figures
    assert err["nearest"][1] < 0.7 * err["truncate"][1], figures
