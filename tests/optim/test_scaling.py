"""Dynamic loss scaling for the packed optimizers (Lewandowski & Kosson, 4.1: "the same applies to loss
scaling"), with torch.amp.GradScaler itself: ordinary steps through torch's protocol for optimizers that
unscale inside their step, and steps inside backward through ``step_in_backward(grad_scale=scaler)``.
Baseline: the same packed optimizer without scaling, or the ordinary GradScaler loop. (The compiled
scaled step against the eager one: tests/optim/test_update.py.)"""

import copy

import pytest
import torch
from torch import nn

from workbench.experiments.packed_bit_optimizers import loss_scaling_curves
from workbench.optim import PackedAdamW, PackedSGD, step_in_backward

BF16, FP16 = torch.bfloat16, torch.float16


def _model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3)).to(dtype)


def _batches(dtype, n=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 12, generator=g).to(dtype), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x).float(), y)


def _scaled_run(model, opt, batches, scaler, *, in_backward, poison=None):
    """Train with ``scaler``; ``poison`` (a set of step indices) multiplies that step's loss by inf."""
    handle = step_in_backward(model, opt, grad_scale=scaler) if in_backward else None
    scales, params = [], []
    for i, (x, y) in enumerate(batches):
        loss = _loss(model, x, y) * (float("inf") if poison and i in poison else 1.0)
        scaler.scale(loss).backward()
        if handle is None:
            scaler.step(opt)
            opt.zero_grad()
        scaler.update()
        scales.append(scaler.get_scale())
        params.append([p.detach().clone() for p in model.parameters()])
    return scales, params, handle


def test_torch_grad_scaler_refuses_fp16_torch_optim_but_drives_packed_optimizers():
    (x, y), = _batches(FP16, 1)
    plain = _model(FP16)
    opt = torch.optim.AdamW(plain.parameters())
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(_loss(plain, x, y)).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.step(opt)
    packed = _model(FP16)
    opt = PackedAdamW(packed.parameters(), extra_bits=13)
    before = [p.detach().clone() for p in packed.parameters()]
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(_loss(packed, x, y)).backward()
    scaler.step(opt)
    scaler.update()
    assert all(not torch.equal(b, p) for b, p in zip(before, packed.parameters(), strict=True))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("make", [lambda ps, f: PackedAdamW(ps, lr=1e-2, extra_bits=16, fused=f, compile=False),
                                  lambda ps, f: PackedSGD(ps, lr=0.1, momentum=0.9, extra_bits=16, fused=f,
                                                          compile=False)])
def test_scaled_training_equals_unscaled_training_bf16(make, fused):
    # bf16 has fp32's exponent range: scaling by 2**16 and unscaling in fp32 inside the step is exact,
    # so the scaled run must equal the unscaled one bit for bit
    batches = _batches(BF16, 5)
    a = _model(BF16)
    b = copy.deepcopy(a)
    opt_a, opt_b = make(list(a.parameters()), fused), make(list(b.parameters()), fused)
    for x, y in batches:
        _loss(a, x, y).backward()
        opt_a.step()
        opt_a.zero_grad()
    scales, _, _ = _scaled_run(b, opt_b, batches, torch.amp.GradScaler("cpu"), in_backward=False)
    assert scales == [2.0**16] * 5
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)


@pytest.mark.parametrize("in_backward", [False, True])
def test_an_overflow_skips_the_update_and_backs_off_the_scale(in_backward):
    model = _model(FP16)
    opt = PackedAdamW(model.parameters(), lr=1e-2, extra_bits=13)
    batches = _batches(FP16, 4)
    scaler = torch.amp.GradScaler("cpu", growth_interval=2)
    scales, params, handle = _scaled_run(model, opt, batches, scaler, in_backward=in_backward, poison={1})
    # GradScaler's constants: back off x0.5 on inf/NaN, grow x2 after growth_interval clean steps
    assert scales == [2.0**16, 2.0**15, 2.0**15, 2.0**16]
    for before, after in zip(params[0], params[1], strict=True):
        assert torch.equal(before, after)  # the poisoned step changed nothing
    assert all(opt.state[p]["step"] == 3 for p in model.parameters())
    if handle is not None:
        # an inf loss makes the first gradient non-finite: every update of that step is skipped
        assert handle.skipped == 4 and handle.steps == 3 * 4


def test_in_backward_an_overflow_skips_the_updates_from_the_first_non_finite_gradient_on():
    # the first layer's gradients complete last in backward; poison only them: the last layer,
    # whose finite gradients completed first, keeps its update, the rest of the step is skipped
    model = _model(FP16)
    opt = PackedAdamW(model.parameters(), lr=1e-2, extra_bits=13)
    scaler = torch.amp.GradScaler("cpu")
    handle = step_in_backward(model, opt, grad_scale=scaler)
    model[0].weight.register_hook(lambda g: g * float("inf"))
    before = [p.detach().clone() for p in model.parameters()]
    (x, y), = _batches(FP16, 1)
    scaler.scale(_loss(model, x, y)).backward()
    scaler.update()
    moved = [not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)]
    assert moved[2:] == [True, True] and not moved[0]  # last layer updated, first layer's weight not
    assert handle.steps + handle.skipped == 4 and handle.skipped >= 1
    assert scaler.get_scale() == 2.0**15


@pytest.mark.parametrize("make", [lambda ps: PackedAdamW(ps, lr=1e-2, extra_bits=13),
                                  lambda ps: torch.optim.AdamW(ps, lr=1e-2)])
def test_in_backward_matches_the_ordinary_grad_scaler_loop(make):
    dtype = FP16 if make([nn.Parameter(torch.zeros(1, dtype=FP16))]).__class__ is PackedAdamW else torch.float32
    batches = _batches(dtype, 6)
    a = _model(dtype)
    b = copy.deepcopy(a)
    runs = []
    for model, in_backward in ((a, False), (b, True)):
        opt = make(list(model.parameters()))
        runs.append(_scaled_run(model, opt, batches, torch.amp.GradScaler("cpu", growth_interval=2),
                                in_backward=in_backward, poison={2}))
    assert runs[0][0] == runs[1][0]
    for step_a, step_b in zip(runs[0][1], runs[1][1], strict=True):
        for p, q in zip(step_a, step_b, strict=True):
            torch.testing.assert_close(q, p, rtol=0, atol=0)


def test_in_backward_scaler_misuse_is_refused():
    model = _model(FP16)
    opt = PackedSGD(model.parameters(), lr=0.1, extra_bits=13)
    scaler = torch.amp.GradScaler("cpu")
    step_in_backward(model, opt, grad_scale=scaler)
    (x, y), = _batches(FP16, 1)
    with pytest.raises(RuntimeError, match=r"the loss was not scaled: call scaler.scale\(loss\).backward\(\)"):
        _loss(model, x, y).backward()
    opt.zero_grad()
    scaler.scale(_loss(model, x, y)).backward()
    with pytest.raises(RuntimeError, match=r"scaler.update\(\) was not called"):
        scaler.scale(_loss(model, x, y)).backward()


def test_fp16_gradients_that_underflow_stall_without_scaling_and_train_with_it():
    df = loss_scaling_curves(steps=12)
    curves = {v: g.sort_values("step") for v, g in df.groupby("variant")}
    plain, scaled, inside, fp32 = (curves[v] for v in ("fp16+13", "fp16+13 GradScaler",
                                                       "fp16+13 GradScaler in backward", "fp32"))
    # no scaling: every gradient flushed to zero, the weights never move, the loss is flat
    assert plain["moved_fraction"].max() == 0 and plain["loss"].nunique() == 1
    # scaled: trains, the same inside backward as with an ordinary step
    assert scaled["loss"].iloc[-1] < 0.8 * scaled["loss"].iloc[0] and scaled["moved_fraction"].iloc[-1] > 0.9
    torch.testing.assert_close(torch.tensor(inside["loss"].values), torch.tensor(scaled["loss"].values),
                               rtol=0, atol=0)
    # and follows fp32 AdamW: the fp16 forward rounds each op to 2**-11; a few such roundings and
    # weights truncated to fp16 keep the loss within 2**-7 relative (16x margin)
    torch.testing.assert_close(torch.tensor(scaled["loss"].values), torch.tensor(fp32["loss"].values),
                               rtol=2**-7, atol=0)
    assert (scaled["loss_scale"] == 2.0**16).all()
