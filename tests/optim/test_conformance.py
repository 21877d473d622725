"""Conformance: the same checks, parametrized, on torch.optim.AdamW / SGD and on PackedAdamW / PackedSGD.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", 3.1 (bf16 + 16 extra bits
is the fp32 master value bit for bit), 3.2 and 4.1 (the step inside backward; clipping, loss scaling
and accumulation through hooks).

The ordinary baseline of every optimizer is torch's optimizer of the same family stepping fp32 master
weights, with the model running a copy in its own dtype: the copy is the master itself for the fp32
torch optimizers, and the master truncated toward zero to bf16 for the packed ones (what bf16 + 16
extra bits hands the model). Where a feature is supported, the loss curve and the master weights must
match that baseline; where torch has no such keyword (SGD's ``amsgrad``, AdamW's ``nesterov``) both
raise the same TypeError; where only torch has it (``foreach``, ``capturable``, ``differentiable``)
the packed optimizers refuse it with a message naming what to use instead.

Tolerances: the master weights within rtol 1e-5, atol 1e-6 (the same fp32 formula evaluated in a
different order: a few fp32 ulps per step, as in test_packed.py); the losses within rtol 2**-8: a
master a few ulps off can truncate to the neighbouring bf16 value (2**-8 relative) in a weight.
"""

import copy
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from workbench.optim import PackedAdamW, PackedOptimizer, PackedSGD, step_in_backward

BF16, FP32 = torch.bfloat16, torch.float32


@dataclass(frozen=True)
class Kind:
    name: str
    cls: type
    dtype: torch.dtype
    twin: type  # torch's optimizer of the same family
    hyper: dict = field(default_factory=dict)
    packed_kw: dict = field(default_factory=dict)

    def make(self, params, **kw):
        return self.cls(params, **self.hyper, **self.packed_kw, **kw)

    @property
    def packed(self) -> bool:
        return issubclass(self.cls, PackedOptimizer)


ADAMW = dict(lr=1e-2)
SGD = dict(lr=0.05, momentum=0.9)
KINDS = [
    Kind("torch.optim.AdamW", torch.optim.AdamW, FP32, torch.optim.AdamW, ADAMW),
    Kind("PackedAdamW bf16+16", PackedAdamW, BF16, torch.optim.AdamW, ADAMW, dict(extra_bits=16)),
    Kind("torch.optim.SGD", torch.optim.SGD, FP32, torch.optim.SGD, SGD),
    Kind("PackedSGD bf16+16", PackedSGD, BF16, torch.optim.SGD, SGD, dict(extra_bits=16)),
]
IDS = [k.name for k in KINDS]


def _model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _batches(dtype, n=6):
    """Micro-batches of a learnable task: labels from a fixed random linear teacher."""
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(6, 3, generator=g)
    xs = [torch.randn(16, 6, generator=g) for _ in range(n)]
    return [(x.to(dtype), (x @ teacher).argmax(1)) for x in xs]


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x).float(), y)


def _copy_of(master, dtype):
    """The model's copy of an fp32 master: itself, or truncated toward zero to bf16 (exact bit masking)."""
    if dtype == FP32:
        return master
    return (master.view(torch.int32) & -65536).view(torch.float32).to(dtype)


def _masters(opt, model):
    ps = list(model.parameters())
    return [opt.master_weight(p) if isinstance(opt, PackedOptimizer) else p.detach().clone() for p in ps]


def _run(kind, batches, *, scheduler=False, **kw):
    """Train ``kind`` itself; returns (losses, fp32 master weights)."""
    model = _model(kind.dtype)
    opt = kind.make(model.parameters(), **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if scheduler else None
    losses = []
    for x, y in batches:
        loss = _loss(model, x, y)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return losses, _masters(opt, model)


def _baseline(kind, batches, *, scheduler=False, **kw):
    """torch's optimizer on fp32 masters, the model running their copy in ``kind.dtype``."""
    model = _model(kind.dtype)
    masters = [nn.Parameter(p.detach().float()) for p in model.parameters()]
    opt = kind.twin(masters, **kind.hyper, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if scheduler else None
    losses = []
    for x, y in batches:
        loss = _loss(model, x, y)
        losses.append(loss.item())
        loss.backward()
        for m, p in zip(masters, model.parameters(), strict=True):
            m.grad, p.grad = p.grad.float(), None
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters(), strict=True):
                p.copy_(_copy_of(m.detach(), kind.dtype))
    return losses, [m.detach().clone() for m in masters]


FEATURES = {
    "defaults": {},
    "weight_decay": {"weight_decay": 0.1},
    "amsgrad": {"amsgrad": True},
    "maximize": {"maximize": True},
    "nesterov": {"nesterov": True},
    "fused": {"fused": True},
    "lr_scheduler": {"scheduler": True},
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_training_matches_the_fp32_master_baseline(kind, feature):
    kw = dict(FEATURES[feature])
    if feature == "fused" and kind.packed:
        kw["compile"] = False  # the eager flat step; the compiled one equals it bit for bit (test_select_step)
    batches = _batches(kind.dtype)
    try:
        kind.twin([nn.Parameter(torch.zeros(1))], **kind.hyper, **{k: v for k, v in kw.items()
                                                                   if k not in ("scheduler", "compile")})
    except TypeError as e:  # torch has no such keyword for this family: neither may we
        with pytest.raises(TypeError, match="unexpected keyword argument"):
            kind.make(_model(kind.dtype).parameters(), **kw)
        assert "unexpected keyword argument" in str(e)
        return
    losses, masters = _run(kind, batches, **kw)
    kw.pop("compile", None)
    ref_losses, ref_masters = _baseline(kind, batches, **kw)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2**-8, atol=0)
    for m, r in zip(masters, ref_masters, strict=True):
        torch.testing.assert_close(m, r, rtol=1e-5, atol=1e-6)
    assert (losses[-1] > losses[0]) == (feature == "maximize")  # it descends, or ascends


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_maximize_equals_minimizing_the_negated_loss(kind):
    batches = _batches(kind.dtype)
    out = []
    for maximize, sign in ((True, 1.0), (False, -1.0)):
        model = _model(kind.dtype)
        opt = kind.make(model.parameters(), maximize=maximize)
        for x, y in batches:
            (sign * _loss(model, x, y)).backward()
            opt.step()
            opt.zero_grad()
        out.append(_masters(opt, model))
    for a, b in zip(*out, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_state_dict_round_trip_resumes_exactly(kind):
    batches = _batches(kind.dtype)
    _, straight = _run(kind, batches)
    model = _model(kind.dtype)
    opt = kind.make(model.parameters())
    for i, (x, y) in enumerate(batches):
        if i == 3:  # save, rebuild from scratch, load
            saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
            model = _model(kind.dtype)
            model.load_state_dict(saved_model)
            opt = kind.make(model.parameters())
            opt.load_state_dict(saved_opt)
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    for a, b in zip(_masters(opt, model), straight, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_step_in_backward_with_accumulation_clipping_and_grad_scaler_equals_the_ordinary_loop(kind):
    # torch's recipe: scale, accumulate 2 micro-batches, unscale_, clip_grad_value_, step, update
    batches, clip = _batches(kind.dtype), 0.05
    out, scales = [], []
    for in_backward in (False, True):
        model = _model(kind.dtype)
        opt = kind.make(model.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1)
        handle = step_in_backward(model, opt, clip_value=clip, grad_scale=scaler, accumulate=2) if in_backward else None
        for i, (x, y) in enumerate(batches, start=1):
            scaler.scale(_loss(model, x, y) / 2).backward()
            if i % 2:
                continue
            if handle is None:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_value_(model.parameters(), clip)
                scaler.step(opt)
                opt.zero_grad()
            scaler.update()
        scales.append(scaler.get_scale())
        out.append(_masters(opt, model))
    assert scales[0] == scales[1] == 2.0**15  # grown once per clean step
    for a, b in zip(*out, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_misuse_after_a_fused_backward_is_refused_alike(kind):
    model = _model(kind.dtype)
    opt = kind.make(model.parameters())
    handle = step_in_backward(model, opt)
    (x, y), = _batches(kind.dtype, 1)
    loss = _loss(model, x, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"clip_value=c"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match=r"second backward.*accumulate=N"):
        loss.backward()
    with pytest.raises(RuntimeError, match=r"already ran inside backward"):
        opt.step()
    handle.remove()


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
@pytest.mark.parametrize("switch", ["foreach", "capturable", "differentiable"])
def test_torch_only_switches_work_in_torch_and_are_refused_by_name_in_packed(kind, switch):
    if kind.twin is torch.optim.SGD and switch == "capturable":
        with pytest.raises(TypeError, match="unexpected keyword argument 'capturable'"):
            torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1, capturable=True)
        return  # torch SGD has no capturable; PackedSGD accepts it only at torch's default
    model = _model(kind.dtype)
    if not kind.packed:
        kind.make(model.parameters(), **{switch: True})  # accepted (capturable then needs CUDA at step)
        return
    with pytest.raises(ValueError, match=rf"{switch}=True is not supported .*(use|step outside)"):
        kind.make(model.parameters(), **{switch: True})
    kind.make(model.parameters(), **{switch: False})  # torch's default is fine
