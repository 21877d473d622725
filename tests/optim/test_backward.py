"""step_in_backward against an ordinary backward + step (Lewandowski & Kosson, sections 3.2 and 4.1)."""

import copy

import pytest
import torch
from torch import nn

from workbench.optim import PackedAdamW, PackedSGD, step_in_backward


def _model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3)).to(dtype)


def _batches(dtype, n=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 12, generator=g).to(dtype), torch.randint(0, 3, (8,), generator=g))
            for _ in range(n)]


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x).float(), y)


def _train(model, opt, batches, *, in_backward, clip_value=None):
    handle = step_in_backward(model, opt, clip_value=clip_value) if in_backward else None
    for x, y in batches:
        _loss(model, x, y).backward()
        if handle is None:
            if clip_value is not None:
                for p in model.parameters():
                    p.grad.clamp_(-clip_value, clip_value)
            opt.step()
            opt.zero_grad()
        else:
            assert all(p.grad is None for p in model.parameters())
    return handle


MAKERS = [
    (torch.bfloat16, lambda ps: PackedAdamW(ps, lr=1e-2, extra_bits=8)),
    (torch.float16, lambda ps: PackedSGD(ps, lr=0.1, momentum=0.9, extra_bits=13,
                                         stochastic_rounding=False)),
    (torch.float32, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3)),
    (torch.float32, lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
]


@pytest.mark.parametrize("clip_value", [None, 1e-3])
@pytest.mark.parametrize(("dtype", "make"), MAKERS)
def test_step_in_backward_equals_normal_step(dtype, make, clip_value):
    batches = _batches(dtype)
    a = _model(dtype)
    b = copy.deepcopy(a)
    opt_a, opt_b = make(list(a.parameters())), make(list(b.parameters()))
    _train(a, opt_a, batches, in_backward=False, clip_value=clip_value)
    handle = _train(b, opt_b, batches, in_backward=True, clip_value=clip_value)
    assert handle.steps == len(batches) * len(list(b.parameters()))
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)


def test_remove_restores_ordinary_stepping():
    model = _model(torch.float16)
    opt = PackedSGD(model.parameters(), lr=0.1, extra_bits=8)
    (x, y), = _batches(torch.float16, 1)
    with step_in_backward(model, opt) as handle:
        assert handle.active
        _loss(model, x, y).backward()
        with pytest.raises(RuntimeError, match="already ran inside backward"):
            opt.step()
    assert not handle.active
    _loss(model, x, y).backward()
    assert all(p.grad is not None for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_refuses_accumulation_and_global_norm_clipping():
    model = _model(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"max_norm=1\.0: global-norm clipping"):
        step_in_backward(model, opt, max_norm=1.0)
    with pytest.raises(ValueError, match=r"accumulation_steps=4.*allowed value: 1"):
        step_in_backward(model, opt, accumulation_steps=4)
    with pytest.raises(ValueError, match="clip_value=0"):
        step_in_backward(model, opt, clip_value=0)
    (x, y), = _batches(torch.float32, 1)
    _loss(model, x, y).backward()  # a gradient is already accumulated
    with pytest.raises(RuntimeError, match="already hold a .grad"):
        step_in_backward(model, opt)
    with pytest.raises(ValueError, match="not in the optimizer"):
        step_in_backward(model, torch.optim.SGD(list(model.parameters())[:1], lr=0.1))


def test_gradients_are_freed_during_backward():
    # with the step inside backward, at most one parameter holds a gradient at any moment
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    live = []

    def spy(p):
        live.append(sum(q.grad is not None for q in model.parameters()))

    handle = step_in_backward(model, opt)
    spies = [p.register_post_accumulate_grad_hook(spy) for p in model.parameters()]
    model(torch.randn(4, 16)).sum().backward()
    handle.remove()
    for s in spies:
        s.remove()
    assert len(live) == 12 and max(live) == 0


@pytest.mark.parametrize(("dtype", "make"), [MAKERS[1], MAKERS[2]])
def test_lr_scheduler_created_after_step_in_backward(dtype, make):
    # optimizer.step stays the bound method (a step pre-hook refuses outside calls), so a scheduler
    # made afterwards can wrap it, and it sees the in-backward updates as optimizer steps
    import warnings

    batches = _batches(dtype, 6)
    a = _model(dtype)
    b = copy.deepcopy(a)
    opt_a, opt_b = make(list(a.parameters())), make(list(b.parameters()))
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, step_size=2, gamma=0.5)
    handle = step_in_backward(b, opt_b)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, step_size=2, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "optimizer.step() overridden" / "called before" warning
        for x, y in batches:
            _loss(a, x, y).backward()
            opt_a.step()
            opt_a.zero_grad()
            sched_a.step()
            _loss(b, x, y).backward()
            sched_b.step()
    assert opt_b.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"] < 0.1 / 4
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="already ran inside backward"):
        opt_b.step()
    handle.remove()
    opt_b.step()  # ordinary stepping again (no gradients: a no-op)
