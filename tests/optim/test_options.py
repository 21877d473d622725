"""PackedOptions: the packed optimizers' keyword options, declared once, behave as the spelled-out
keywords did (signatures, defaults, Python's own errors for unknown or missing keywords, per-group
checks). Tests ``workbench.optim.options``."""

import dataclasses
import inspect

import pytest
import torch

from workbench.optim import PackedAdam, PackedAdamW, PackedOptimizer, PackedOptions, PackedSGD

OPTIONS = ["extra_bits", "stochastic_rounding", "master_rounding", "state_dtype", "fused", "compile", "seed",
           "foreach", "capturable", "differentiable"]


def _p():
    return [torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))]


def test_every_option_is_declared_once_with_its_default():
    fields = {f.name: f for f in dataclasses.fields(PackedOptions)}
    assert list(fields) == OPTIONS
    assert fields["extra_bits"].default is dataclasses.MISSING
    opts = PackedOptions(extra_bits=3)
    assert (opts.stochastic_rounding, opts.master_rounding, opts.state_dtype, opts.fused, opts.compile,
            opts.seed) == (False, "truncate", torch.float32, False, None, None)
    assert (opts.foreach, opts.capturable, opts.differentiable) == (None, False, False)  # torch's defaults


@pytest.mark.parametrize(("cls", "own"), [
    (PackedSGD, ["params", "lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"]),
    (PackedAdamW, ["params", "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled"]),
    (PackedAdam, ["params", "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"]),
    (PackedOptimizer, ["params", "defaults"]),
])
def test_constructors_spell_out_the_options(cls, own):
    sig = inspect.signature(cls)
    assert list(sig.parameters) == own + OPTIONS
    for name in OPTIONS:
        p = sig.parameters[name]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY
        field = next(f for f in dataclasses.fields(PackedOptions) if f.name == name)
        assert p.default == (inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: PackedSGD(_p(), lr=0.1, extra_bits=3, foo=1),
     "PackedSGD.__init__() got an unexpected keyword argument 'foo'"),
    (lambda: PackedSGD(_p(), lr=0.1), "PackedSGD.__init__() missing 1 required keyword-only argument: 'extra_bits'"),
    (lambda: PackedAdamW(_p()), "PackedAdamW.__init__() missing 1 required keyword-only argument: 'extra_bits'"),
    (lambda: PackedAdam(_p(), extra_bits=3, decoupled=True),
     "PackedAdam.__init__() got an unexpected keyword argument 'decoupled'"),
    (lambda: PackedOptimizer(_p(), {"lr": 1.0, "weight_decay": 0.0}, extra_bits=3, zz=1),
     "PackedOptimizer.__init__() got an unexpected keyword argument 'zz'"),
    (lambda: PackedAdamW(_p(), extra_bits=3, seed=1.5), "seed=1.5 must be an int or None"),
    (lambda: PackedSGD(_p(), lr=1.0, extra_bits=3, seed=True), "seed=True must be an int or None"),
])
def test_keyword_errors_read_as_before(make, message):
    with pytest.raises(TypeError) as info:
        make()
    assert str(info.value) == message


def test_options_become_group_defaults_and_groups_may_override_them():
    opt = PackedAdam(_p(), extra_bits=3, stochastic_rounding=1, fused=0, seed=4, compile=False)
    assert opt.defaults["stochastic_rounding"] is True and opt.defaults["fused"] is False
    assert {k: opt.defaults[k] for k in PackedOptions.GROUP} == {
        "extra_bits": 3, "stochastic_rounding": True, "master_rounding": "truncate",
        "state_dtype": torch.float32, "fused": False}
    assert opt.seed == 4 and opt.compile is False and opt.defaults["decoupled"] is False
    opt.add_param_group({"params": _p(), "extra_bits": 8, "master_rounding": "stochastic"})
    assert opt.param_groups[1]["extra_bits"] == 8 and opt.param_groups[1]["master_rounding"] == "stochastic"
    with pytest.raises(ValueError, match=r"master_rounding=1: allowed \('truncate', 'stochastic', 'nearest'\)"):
        opt.add_param_group({"params": _p(), "master_rounding": 1})
    with pytest.raises(ValueError, match=r"extra_bits=20 out of range for torch.bfloat16: allowed 0\.\.16"):
        opt.add_param_group({"params": _p(), "extra_bits": 20})
    assert len(opt.param_groups) == 2  # a refused group is not kept


def test_the_seed_is_drawn_when_not_given():
    torch.manual_seed(0)
    a = PackedSGD(_p(), lr=0.1, extra_bits=3).seed
    torch.manual_seed(0)
    assert PackedSGD(_p(), lr=0.1, extra_bits=3).seed == a and isinstance(a, int)


@pytest.mark.parametrize("cls", [PackedAdamW, PackedSGD])
def test_torch_only_switches_are_refused_with_what_to_use_instead(cls):
    kw = {"lr": 0.1} if cls is PackedSGD else {}
    # torch's defaults are accepted, so code written for torch.optim runs unchanged
    cls(_p(), **kw, extra_bits=3, foreach=None, capturable=False, differentiable=False)
    cls(_p(), **kw, extra_bits=3, foreach=False)
    for name, fix in [("foreach", "use fused=True"), ("capturable", "step outside graph capture"),
                      ("differentiable", r"differentiable=True\) on fp32 parameters")]:
        with pytest.raises(ValueError, match=rf"{cls.__name__}: {name}=True is not supported \(allowed: .*\): .*{fix}"):
            cls(_p(), **kw, extra_bits=3, **{name: True})
    with pytest.raises(TypeError, match=r"compile='yes' must be True, False or None"):
        cls(_p(), **kw, extra_bits=3, compile="yes")
