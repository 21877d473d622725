"""step_in_backward against an ordinary backward + step (Lewandowski & Kosson, sections 3.2 and 4.1):
clipping, static loss scaling and gradient accumulation in the hook, and the misuses it refuses.
(Dynamic loss scaling: test_scaling.py; the same checks on every optimizer: test_conformance.py.)"""

import copy
import warnings

import pytest
import torch
from torch import nn

from workbench.optim import AppliedGradient, PackedAdamW, PackedOptimizer, PackedSGD, step_in_backward


def _model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3)).to(dtype)


def _batches(dtype, n=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 12, generator=g).to(dtype), torch.randint(0, 3, (8,), generator=g))
            for _ in range(n)]


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x).float(), y)


def _ordinary_step(model, opt, *, clip_value=None, scale=None):
    """What an ordinary loop does after backward: unscale, clip by value, step, zero."""
    if scale is not None:
        if isinstance(opt, PackedOptimizer) and clip_value is None:  # torch.amp's protocol: unscaled in fp32
            opt.grad_scale = torch.tensor(scale)
        else:
            for p in model.parameters():
                p.grad.mul_(1 / scale)  # a power of two: exact in fp32 and bf16 (fp16 + clip is skipped)
    if clip_value is not None:
        torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
    opt.step()
    opt.__dict__.pop("grad_scale", None)
    opt.zero_grad()


def _train(model, opt, batches, *, in_backward, clip_value=None, scale=None):
    handle = step_in_backward(model, opt, clip_value=clip_value, grad_scale=scale) if in_backward else None
    for x, y in batches:
        loss = _loss(model, x, y)
        (loss * scale if scale is not None else loss).backward()
        if handle is None:
            _ordinary_step(model, opt, clip_value=clip_value, scale=scale)
        else:
            assert all(type(p.grad) is AppliedGradient for p in model.parameters())
    return handle


MAKERS = [
    (torch.bfloat16, lambda ps: PackedAdamW(ps, lr=1e-2, extra_bits=8)),
    (torch.float16, lambda ps: PackedSGD(ps, lr=0.1, momentum=0.9, extra_bits=13,
                                         stochastic_rounding=False)),
    (torch.float32, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3)),
    (torch.float32, lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
]


@pytest.mark.parametrize(("clip_value", "scale"), [(None, None), (1e-3, None), (None, 1024.0), (1e-3, 1024.0)])
@pytest.mark.parametrize(("dtype", "make"), MAKERS)
def test_step_in_backward_equals_normal_step(dtype, make, clip_value, scale):
    if dtype == torch.float16 and clip_value is not None and scale is not None:
        pytest.skip("no ordinary fp16 baseline: clip_grad_value_ needs the gradients unscaled first, in fp16, "
                    "which torch.amp.GradScaler refuses")
    batches = _batches(dtype)
    a = _model(dtype)
    b = copy.deepcopy(a)
    opt_a, opt_b = make(list(a.parameters())), make(list(b.parameters()))
    _train(a, opt_a, batches, in_backward=False, clip_value=clip_value, scale=scale)
    handle = _train(b, opt_b, batches, in_backward=True, clip_value=clip_value, scale=scale)
    assert handle.steps == len(batches) * len(list(b.parameters())) and handle.skipped == 0
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)


@pytest.mark.parametrize(("dtype", "make"), MAKERS)
def test_accumulate_equals_ordinary_gradient_accumulation(dtype, make):
    # accumulate=2 keeps the gradients of two micro-batches and steps in the second backward: the
    # same parameters as two backward passes, one step and zero_grad in an ordinary loop
    batches = _batches(dtype, 6)
    a = _model(dtype)
    b = copy.deepcopy(a)
    opt_a, opt_b = make(list(a.parameters())), make(list(b.parameters()))
    for i, (x, y) in enumerate(batches, start=1):
        (_loss(a, x, y) / 2).backward()
        if i % 2 == 0:
            opt_a.step()
            opt_a.zero_grad()
    handle = step_in_backward(b, opt_b, accumulate=2)
    kinds = []
    for x, y in batches:
        (_loss(b, x, y) / 2).backward()
        kinds.append({type(p.grad) for p in b.parameters()})
    assert kinds == [{torch.Tensor}, {AppliedGradient}] * 3  # kept, then applied and freed
    assert handle.steps == 3 * len(list(b.parameters()))
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)


def test_remove_restores_ordinary_stepping():
    model = _model(torch.float16)
    opt = PackedSGD(model.parameters(), lr=0.1, extra_bits=8)
    (x, y), = _batches(torch.float16, 1)
    with step_in_backward(model, opt) as handle:
        assert handle.active
        _loss(model, x, y).backward()
        with pytest.raises(RuntimeError, match="already ran inside backward.*accumulate=N"):
            opt.step()
    assert not handle.active and all(p.grad is None for p in model.parameters())
    _loss(model, x, y).backward()
    assert all(p.grad is not None for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_bad_arguments_are_refused_early():
    model = _model(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"max_norm=1\.0: global-norm clipping"):
        step_in_backward(model, opt, max_norm=1.0)
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match=rf"accumulate={bad!r}: allowed integers >= 1"):
            step_in_backward(model, opt, accumulate=bad)
    with pytest.raises(ValueError, match=r"clip_value=0: allowed finite numbers > 0"):
        step_in_backward(model, opt, clip_value=0)
    with pytest.raises(ValueError, match=r"grad_scale=-1\.0: allowed finite numbers > 0"):
        step_in_backward(model, opt, grad_scale=-1.0)
    half = _model(torch.float16)
    with pytest.raises(ValueError, match=r"grad_scale with SGD on torch.float16 parameters.*use a packed"):
        step_in_backward(half, torch.optim.SGD(half.parameters(), lr=0.1), grad_scale=1024.0)
    (x, y), = _batches(torch.float32, 1)
    _loss(model, x, y).backward()  # a gradient is already accumulated
    with pytest.raises(RuntimeError, match="already hold a .grad.*accumulate=N"):
        step_in_backward(model, opt)
    with pytest.raises(ValueError, match="not in the optimizer"):
        step_in_backward(model, torch.optim.SGD(list(model.parameters())[:1], lr=0.1))


@pytest.mark.parametrize(("dtype", "make"), [MAKERS[0], MAKERS[3]])
def test_a_second_backward_before_the_next_forward_is_refused(dtype, make):
    model = _model(dtype)
    opt = make(list(model.parameters()))
    handle = step_in_backward(model, opt)
    (x, y), = _batches(dtype, 1)
    out = model(x).float()
    nn.functional.cross_entropy(out, y).backward(retain_graph=True)
    after_first = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"second backward.*sum the losses.*accumulate=N"):
        out.pow(2).mean().backward()  # a second loss of the same forward
    # refused as the backward entered the model, before any parameter moved
    for p, q in zip(model.parameters(), after_first, strict=True):
        assert torch.equal(p.detach(), q)
    _loss(model, x, y).backward()  # a new forward: fine again
    assert handle.steps == 2 * len(after_first)


@pytest.mark.parametrize("clip", [lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0),
                                  lambda ps: torch.nn.utils.clip_grad_value_(ps, 1.0)])
def test_clipping_gradients_already_applied_is_refused(clip):
    model = _model(torch.bfloat16)
    opt = PackedAdamW(model.parameters(), extra_bits=8)
    handle = step_in_backward(model, opt)
    (x, y), = _batches(torch.bfloat16, 1)
    _loss(model, x, y).backward()
    with pytest.raises(RuntimeError, match=r"already applied.*step_in_backward\(\.\.\., clip_value=c\)"):
        clip(model.parameters())
    # metadata stays readable and costs no memory; zero_grad(set_to_none=False) is a no-op
    g = model[0].weight.grad
    assert g.shape == model[0].weight.shape and g.untyped_storage().nbytes() == 2
    opt.zero_grad(set_to_none=False)
    model(x)  # the next forward puts None back
    assert all(p.grad is None for p in model.parameters())
    handle.remove()


def test_zeroing_gradients_between_accumulated_micro_batches_is_refused():
    model = _model(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step_in_backward(model, opt, accumulate=3)
    (x, y), = _batches(torch.float32, 1)
    _loss(model, x, y).backward()
    opt.zero_grad()  # the habit of an ordinary loop: would drop the first micro-batch
    with pytest.raises(RuntimeError, match=r"accumulated over earlier micro-batches was replaced.*zero_grad"):
        _loss(model, x, y).backward()


def test_gradients_are_freed_during_backward():
    # with the step inside backward, no parameter holds a real gradient at any moment
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    live = []

    def spy(p):
        live.append(sum(type(q.grad) is torch.Tensor for q in model.parameters()))

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


def test_an_evaluation_under_no_grad_is_not_a_micro_batch():
    # accumulate counts forwards with gradients on: a no_grad evaluation between micro-batches
    # neither advances the count nor frees the applied gradients' markers
    batches = _batches(torch.float32, 4)
    a = _model(torch.float32)
    b = copy.deepcopy(a)
    opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b))
    step_in_backward(a, opt_a, accumulate=2)
    step_in_backward(b, opt_b, accumulate=2)
    for x, y in batches:
        _loss(a, x, y).backward()
        _loss(b, x, y).backward()
        with torch.no_grad():
            b(x)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
    assert all(type(p.grad) is AppliedGradient for p in b.parameters())
