"""PackedSGD / PackedAdamW / PackedAdam against torch.optim (Lewandowski & Kosson, 3.1)."""

import copy
import math

import pytest
import torch

from workbench.optim import PackedAdam, PackedAdamW, PackedSGD, master_weight, merge, split

BF16, FP16 = torch.bfloat16, torch.float16
SHAPES = [(37, 5), (64,), (3, 3, 3), (1,)]


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _grads(dtype, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g).to(dtype) for s in SHAPES] for _ in range(steps)]


def _run(opt, params, grads, scheduler=None):
    for gs in grads:
        for p, g in zip(params, gs, strict=True):
            p.grad = g.clone().to(p.dtype)
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


CASES = [
    (PackedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (PackedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.01, betas=(0.8, 0.99))),
    (PackedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-3)),
    (PackedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    (PackedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.5, dampening=0.3)),
    (PackedSGD, torch.optim.SGD, dict(lr=0.05)),
    (PackedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (PackedAdamW, torch.optim.AdamW, dict(lr=1e-2, maximize=True, amsgrad=True)),
    (PackedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.01, amsgrad=True, maximize=True)),
    (PackedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, maximize=True)),
]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(("packed_cls", "torch_cls", "kw"), CASES)
def test_parity_with_torch_optim_bf16_plus_16(packed_cls, torch_cls, kw, fused):
    params = _params(BF16)
    ref = [torch.nn.Parameter(p.detach().float()) for p in params]
    grads = _grads(BF16, 100)
    opt = packed_cls(params, **kw, extra_bits=16, fused=fused, compile=False)  # the eager flat step
    _run(opt, params, grads)
    _run(torch_cls(ref, **kw), ref, grads)
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(opt.master_weight(p), r.detach(), rtol=1e-5, atol=1e-6)
        # the model sees the master value truncated toward zero to bf16
        truncated = split(opt.master_weight(p), dtype=BF16, extra_bits=0)[0]
        assert torch.equal(p.detach().view(torch.int16), truncated.view(torch.int16))


def test_param_groups_and_lr_scheduler_parity():
    params = _params(BF16)
    ref = [torch.nn.Parameter(p.detach().float()) for p in params]
    grads = _grads(BF16, 30)

    def groups(ps):
        return [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.01, "momentum": 0.5}]

    opt = PackedSGD(groups(params), lr=0.1, momentum=0.9, extra_bits=16)
    ref_opt = torch.optim.SGD(groups(ref), lr=0.1, momentum=0.9)
    _run(opt, params, grads, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=30))
    _run(ref_opt, ref, grads, torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, T_max=30))
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(master_weight(opt, p), r.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("dtype", "k", "sr", "mr"), [(FP16, 8, False, "truncate"), (BF16, 5, False, "truncate"),
                                                     (FP16, 13, False, "truncate"), (BF16, 8, True, "stochastic"),
                                                     (FP16, 4, True, "truncate"), (BF16, 16, False, "stochastic")])
def test_fused_eager_equals_per_parameter_step(dtype, k, sr, mr):
    # random bits are a hash of (seed, group, step, position in the group's stream): the fused flat
    # step and the per-parameter step draw the same ones
    grads = _grads(dtype, 10)
    out = []
    for fused in (False, True):
        params = _params(dtype)
        opt = PackedAdamW(params, lr=1e-2, extra_bits=k, fused=fused, compile=False, stochastic_rounding=sr,
                          master_rounding=mr, seed=11)
        _run(opt, params, grads)
        out.append([(p.detach().clone(), opt.state[p]["extra"].clone()) for p in params])
    for (a, ea), (b, eb) in zip(*out, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)) and torch.equal(ea, eb)


@pytest.mark.parametrize(("dtype", "k", "sr"), [(FP16, 8, True), (BF16, 16, False)])
def test_compiled_fused_step_equals_eager(dtype, k, sr):
    # one compile each (C++ codegen, seconds on CPU): 9 stored bits (general packing, stochastic
    # rounding) and 16 stored bits (word-aligned packing fused into the update loop)
    grads = _grads(dtype, 3)
    out = []
    for compile_ in (False, True):
        params = _params(dtype)
        opt = PackedAdamW(params, lr=1e-2, extra_bits=k, fused=True, compile=compile_,
                          stochastic_rounding=sr, seed=5)
        _run(opt, params, grads)
        out.append([(p.detach().clone(), opt.state[p]["extra"].clone()) for p in params])
    for (a, ea), (b, eb) in zip(*out, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)) and torch.equal(ea, eb)


@pytest.mark.parametrize(("cls", "kw"), [(PackedAdamW, dict(lr=1e-2)),
                                         (PackedSGD, dict(lr=0.1, momentum=0.9))])
@pytest.mark.parametrize(("dtype", "k", "sr", "fused"),
                         [(BF16, 16, False, False), (FP16, 7, True, False), (FP16, 8, True, True),
                          (BF16, 8, False, True)])
def test_state_dict_round_trip_reproduces_packed_bits(cls, kw, dtype, k, sr, fused):
    grads = _grads(dtype, 10)
    params = _params(dtype)
    opt = cls(params, **kw, extra_bits=k, stochastic_rounding=sr, fused=fused, compile=False, seed=0,
              master_rounding="stochastic", state_dtype=torch.bfloat16)
    _run(opt, params, grads[:5])
    saved = copy.deepcopy(opt.state_dict())
    clone = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = cls(clone, **kw, extra_bits=k, stochastic_rounding=sr, fused=fused, compile=False, seed=123,
               master_rounding="stochastic", state_dtype=torch.bfloat16)
    opt2.load_state_dict(saved)
    for p, q in zip(params, clone, strict=True):
        for key, v in opt.state[p].items():
            w = opt2.state[q][key]
            assert (torch.equal(v, w) and v.dtype == w.dtype) if torch.is_tensor(v) else v == w, key
    _run(opt, params, grads[5:])
    _run(opt2, clone, grads[5:])
    for p, q in zip(params, clone, strict=True):
        assert torch.equal(p.detach().view(torch.int16), q.detach().view(torch.int16))
        assert torch.equal(opt.state[p]["extra"], opt2.state[q]["extra"])


def test_master_weight_and_state_layout():
    params = _params(FP16)
    opt = PackedAdamW(params, extra_bits=8)
    torch.testing.assert_close(opt.master_weight(params[0]), params[0].detach().float())
    _run(opt, params, _grads(FP16, 2))
    st = opt.state[params[0]]
    # 8 stored bits: one uint8 byte plane per value; 5 bits: dense int32 words (Fig 1)
    assert st["extra"].dtype == torch.uint8 and st["extra"].shape == (1, 185)
    assert st["exp_avg"].dtype == torch.float32 and st["step"] == 2
    torch.testing.assert_close(
        opt.master_weight(params[0]), merge(params[0].detach(), st["extra"], extra_bits=8)
    )
    opt5 = PackedAdamW(params, extra_bits=5, stochastic_rounding=True, state_dtype=torch.bfloat16)
    _run(opt5, params, _grads(FP16, 1))
    st5 = opt5.state[params[0]]
    assert st5["extra"].dtype == torch.int32 and st5["extra"].numel() == (185 * 6 + 31) // 32
    assert st5["exp_avg"].dtype == st5["exp_avg_sq"].dtype == torch.bfloat16


def test_extra_bits_keep_small_updates_that_16_bits_absorb():
    # an update far below half an fp16 ulp: plain fp16 SGD (round to nearest) never moves,
    # fp16 + 8 packed bits accumulates it like fp32
    start = torch.full((100,), 1.0)
    plain = torch.nn.Parameter(start.half())
    packed = torch.nn.Parameter(start.half())
    opts = [torch.optim.SGD([plain], lr=1e-4), PackedSGD([packed], lr=1e-4, extra_bits=8)]
    for _ in range(200):
        plain.grad, packed.grad = torch.ones_like(plain), torch.ones_like(packed)
        for o in opts:
            o.step()
    assert torch.equal(plain.detach().float(), start)
    moved = (start - opts[1].master_weight(packed)).mean().item()
    # each step truncates toward zero by less than one ulp of the 18-bit significand (2**-19)
    assert abs(moved - 200 * 1e-4) <= 200 * 2.0**-19


def test_bad_input_raises():
    with pytest.raises(TypeError, match=r"parameter 1 of group 0 .*torch.float32"):
        PackedAdamW([torch.nn.Parameter(torch.zeros(2).half()), torch.nn.Parameter(torch.zeros(2))],
                    extra_bits=8)
    with pytest.raises(ValueError, match=r"extra_bits=14.*0\.\.13"):
        PackedSGD([torch.nn.Parameter(torch.zeros(2).half())], lr=0.1, extra_bits=14)
    with pytest.raises(ValueError, match=r"extra_bits=17.*0\.\.16"):
        PackedSGD([torch.nn.Parameter(torch.zeros(2).bfloat16())], lr=0.1, extra_bits=17)
    with pytest.raises(ValueError, match=r"lr=-1 out of range.*\[0\.0, inf\]"):
        PackedSGD([torch.nn.Parameter(torch.zeros(2).half())], lr=-1, extra_bits=1)
    with pytest.raises(ValueError, match="weight_decay=-0.1"):
        PackedAdamW([torch.nn.Parameter(torch.zeros(2).half())], weight_decay=-0.1, extra_bits=1)
    with pytest.raises(ValueError, match="momentum=-0.5"):
        PackedSGD([torch.nn.Parameter(torch.zeros(2).half())], lr=0.1, momentum=-0.5, extra_bits=1)
    with pytest.raises(ValueError, match="betas"):
        PackedAdamW([torch.nn.Parameter(torch.zeros(2).half())], betas=(1.0, 0.9), extra_bits=1)
    with pytest.raises(ValueError, match="mixes"):
        PackedAdamW([torch.nn.Parameter(torch.zeros(2).half()),
                     torch.nn.Parameter(torch.zeros(2).bfloat16())], extra_bits=8, fused=True)


def _p():
    return [torch.nn.Parameter(torch.zeros(2).half())]


def test_hyperparameters_of_wrong_type_or_non_finite_raise():
    for bad in ("0.1", None, True, [0.1]):
        with pytest.raises(TypeError, match=r"lr=.*must be a real number"):
            PackedAdamW(_p(), lr=bad, extra_bits=8)
        with pytest.raises(TypeError, match=r"weight_decay=.*must be a real number"):
            PackedSGD(_p(), lr=0.1, weight_decay=bad, extra_bits=8)
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match=r"lr=(nan|inf|-inf) out of range: allowed finite"):
            PackedSGD(_p(), lr=bad, extra_bits=8)
        with pytest.raises(ValueError, match=r"weight_decay=.* out of range"):
            PackedAdamW(_p(), weight_decay=bad, extra_bits=8)
    with pytest.raises(ValueError, match=r"lr=.* out of range"):  # per group too
        PackedSGD([{"params": _p(), "lr": math.nan}], lr=0.1, extra_bits=8)
    with pytest.raises(TypeError, match=r"extra_bits=8.0"):
        PackedAdamW(_p(), extra_bits=8.0)
    with pytest.raises(ValueError, match=r"master_rounding='round'.*truncate.*stochastic.*nearest"):
        PackedAdamW(_p(), extra_bits=8, master_rounding="round")
    with pytest.raises(TypeError, match=r"state_dtype=torch.float16.*float32.*bfloat16"):
        PackedAdamW(_p(), extra_bits=8, state_dtype=torch.float16)
    PackedAdamW(_p(), lr=torch.tensor(1e-3), extra_bits=8)  # a 0-dim tensor lr, as torch allows


def test_sgd_momentum_set_only_in_one_param_group_matches_torch():
    params = _params(BF16)
    ref = [torch.nn.Parameter(p.detach().float()) for p in params]
    grads = _grads(BF16, 20)

    def groups(ps):
        return [{"params": ps[:2]}, {"params": ps[2:], "momentum": 0.9, "nesterov": True}]

    for fused in (False, True):
        ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt = PackedSGD(groups(ps), lr=0.05, extra_bits=16, fused=fused, compile=False)  # default momentum 0
        rs = [torch.nn.Parameter(r.detach().clone()) for r in ref]
        _run(opt, ps, grads)
        _run(torch.optim.SGD(groups(rs), lr=0.05), rs, grads)
        for p, r in zip(ps, rs, strict=True):
            torch.testing.assert_close(opt.master_weight(p), r.detach(), rtol=1e-5, atol=1e-6)
        assert "momentum_buffer" not in opt.state[ps[0]] and "momentum_buffer" in opt.state[ps[2]]


def _adamw_bf16_moments(ref, grads, *, lr, wd, betas=(0.9, 0.999), eps=1e-8):
    """torch.optim.AdamW's formula in fp32; both moments are kept in bf16 between steps."""
    ms = [torch.zeros_like(r, dtype=BF16) for r in ref]
    vs = [torch.zeros_like(r, dtype=BF16) for r in ref]
    for t, gs in enumerate(grads, start=1):
        for r, g, m, v in zip(ref, gs, ms, vs, strict=True):
            g = g.float()
            r.mul_(1 - lr * wd)
            m32 = m.float() * betas[0] + g * (1 - betas[0])
            v32 = v.float() * betas[1] + g * g * (1 - betas[1])
            m.copy_(m32)
            v.copy_(v32)
            denom = v32.sqrt() / math.sqrt(1 - betas[1] ** t) + eps
            r.sub_(lr / (1 - betas[0] ** t) * m32 / denom)


@pytest.mark.parametrize("fused", [False, True])
def test_bf16_state_dtype_parity_with_torch_adamw(fused):
    steps, lr = 50, 1e-2
    params = _params(BF16)
    ref = [p.detach().float() for p in params]
    ref32 = [torch.nn.Parameter(p.detach().float()) for p in params]
    grads = _grads(BF16, steps)
    opt = PackedAdamW(params, lr=lr, weight_decay=0.1, extra_bits=16, fused=fused, compile=False, state_dtype=BF16)
    _run(opt, params, grads)
    _adamw_bf16_moments(ref, grads, lr=lr, wd=0.1)
    _run(torch.optim.AdamW(ref32, lr=lr, weight_decay=0.1), ref32, grads)
    assert opt.state[params[0]]["exp_avg"].dtype == BF16
    for p, r, r32 in zip(params, ref, ref32, strict=True):
        # the same arithmetic with bf16 moments: a few fp32 ulps
        torch.testing.assert_close(opt.master_weight(p), r, rtol=1e-5, atol=1e-6)
        # against fp32 torch.optim.AdamW: each step's update is off by at most ~2**-7 of lr
        torch.testing.assert_close(opt.master_weight(p), r32.detach(), rtol=0, atol=steps * lr * 2**-7)


def test_sgd_bf16_momentum_buffer_parity():
    params = _params(FP16)
    ref = [torch.nn.Parameter(p.detach().float()) for p in params]
    grads = _grads(FP16, 30)
    opt = PackedSGD(params, lr=0.01, momentum=0.9, extra_bits=13, state_dtype=BF16)
    _run(opt, params, grads)
    _run(torch.optim.SGD(ref, lr=0.01, momentum=0.9), ref, grads)
    assert opt.state[params[0]]["momentum_buffer"].dtype == BF16
    for p, r in zip(params, ref, strict=True):
        # |momentum| <= 10 max|g| (~50), stored to 2**-8 relative: <= lr * 0.2 per step
        torch.testing.assert_close(opt.master_weight(p), r.detach(), rtol=0, atol=30 * 0.01 * 0.2)


@pytest.mark.parametrize("k", [0, 4, 8])
def test_stochastic_master_rounding_does_not_drift(k):
    # 200 SGD steps of +1e-4 from 1.0 (the drift case): truncating the master value at
    # bf16 + 4 bits loses every update; rounding it stochastically keeps the mean on target
    n, steps, lr = 2000, 200, 1e-4
    exact = 1.0 + steps * lr
    out = {}
    for mode in ("truncate", "stochastic"):
        p = torch.nn.Parameter(torch.ones(n, dtype=BF16))
        opt = PackedSGD([p], lr=lr, extra_bits=k, master_rounding=mode, seed=k)
        for _ in range(steps):
            p.grad = -torch.ones_like(p)
            opt.step()
        out[mode] = opt.master_weight(p).double()
    ulp = 2.0 ** -(7 + k)  # spacing of the kept value in [1, 2)
    sigma = ulp * math.sqrt(steps / 4 / n)  # each step adds independent rounding noise, variance <= ulp**2 / 4
    assert abs(out["stochastic"].mean().item() - exact) < 5 * sigma + 1e-7
    if k == 4:
        assert torch.all(out["truncate"] == 1.0)


def test_zero_grad_set_to_none_frees_the_fused_gradient_buffer():
    import gc
    import weakref

    params = _params(BF16)
    opt = PackedAdamW(params, extra_bits=8, fused=True, compile=False)
    _run(opt, params, _grads(BF16, 1)[:1])  # _run ends with zero_grad() (set_to_none=True)
    for p, g in zip(params, _grads(BF16, 1)[0], strict=True):
        p.grad = g.clone()
    opt.step()
    base = params[0].grad._base  # the flat gradient buffer the step gathered into
    assert base is not None and base.numel() >= sum(p.numel() for p in params)
    ref = weakref.ref(base)
    del base
    opt.zero_grad(set_to_none=False)  # gradients stay views: the buffer is kept and reused
    gc.collect()
    assert ref() is not None
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert ref() is None


def test_stochastic_rounding_step_peak_within_one_percent():
    from workbench.measure import MemoryMeter

    from workbench.optim.update import CHUNK

    n = 1 << 21
    peaks, transient = {}, {}
    for sr in (False, True):
        p = torch.nn.Parameter(torch.randn(n).bfloat16())
        k = 7 if sr else 8  # both store 8 bits per value (one byte plane)
        opt = PackedAdamW([p], extra_bits=k, stochastic_rounding=sr, seed=0)
        p.grad = torch.randn_like(p)
        opt.step()  # states exist from here on
        resident = sum(t.nbytes for t in opt.state[p].values() if torch.is_tensor(t)) + 2 * p.nbytes
        with MemoryMeter("cpu") as meter:
            opt.step()
        peaks[sr] = resident + meter.peak_bytes
        transient[sr] = meter.peak_bytes
    assert peaks[True] <= 1.01 * peaks[False], peaks
    # the random bits are drawn per chunk: SR adds at most a few bytes per value of one chunk
    assert transient[True] - transient[False] <= 8 * CHUNK, transient
