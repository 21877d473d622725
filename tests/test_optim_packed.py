"""PackedSGD / PackedAdamW / PackedAdam against torch.optim (paper 004, 3.1)."""

import copy

import pytest
import torch

from workbench.optim import PackedAdam, PackedAdamW, PackedSGD, master_weight
from workbench.optim.bits import merge, split

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
]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(("packed_cls", "torch_cls", "kw"), CASES)
def test_parity_with_torch_optim_bf16_plus_16(packed_cls, torch_cls, kw, fused):
    params = _params(BF16)
    ref = [torch.nn.Parameter(p.detach().float()) for p in params]
    grads = _grads(BF16, 100)
    opt = packed_cls(params, **kw, extra_bits=16, fused=fused)
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


@pytest.mark.parametrize(("dtype", "k", "sr"), [(FP16, 8, False), (BF16, 5, False), (FP16, 13, False)])
def test_fused_eager_equals_per_parameter_step(dtype, k, sr):
    grads = _grads(dtype, 10)
    out = []
    for fused in (False, True):
        params = _params(dtype)
        opt = PackedAdamW(params, lr=1e-2, extra_bits=k, fused=fused, stochastic_rounding=sr)
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
                         [(BF16, 16, False, False), (FP16, 7, True, False), (FP16, 8, True, True)])
def test_state_dict_round_trip_reproduces_packed_bits(cls, kw, dtype, k, sr, fused):
    grads = _grads(dtype, 10)
    params = _params(dtype)
    opt = cls(params, **kw, extra_bits=k, stochastic_rounding=sr, fused=fused, seed=0)
    _run(opt, params, grads[:5])
    saved = copy.deepcopy(opt.state_dict())
    clone = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = cls(clone, **kw, extra_bits=k, stochastic_rounding=sr, fused=fused, seed=123)
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
    assert st["extra"].dtype == torch.int32 and st["extra"].numel() == (185 * 8 + 31) // 32
    assert st["exp_avg"].dtype == torch.float32 and st["step"] == 2
    torch.testing.assert_close(
        opt.master_weight(params[0]), merge(params[0].detach(), st["extra"], extra_bits=8)
    )


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
    with pytest.raises(ValueError, match="lr=-1"):
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
