"""load_state_dict validates first (Lewandowski & Kosson, 3.1: a packed optimizer's state is its
parameters' extra bits beside the moments): a state dict of another optimizer, or with a state of the
wrong shape, is refused with a ValueError naming the param group or parameter, the key, and what was
expected and found, before anything is loaded. Tests ``workbench.optim.state_check``."""

import copy

import pytest
import torch

from workbench.optim import PackedAdamW, PackedSGD

BF16 = torch.bfloat16


def _params(dtype=BF16):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in [(5, 3), (7,)]]


def _stepped(opt, params, steps=2):
    for _ in range(steps):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        opt.zero_grad()
    return copy.deepcopy(opt.state_dict())


def _target():
    params = _params()
    return PackedAdamW(params, lr=1e-2, extra_bits=8), params


def _refused(sd, match):
    opt, params = _target()
    saved = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    assert opt.state_dict()["param_groups"] == saved["param_groups"] and not opt.state  # nothing loaded


def test_a_torch_adamw_state_dict_is_refused_at_load_not_at_step():
    ref = [torch.nn.Parameter(p.detach().float()) for p in _params()]
    sd = _stepped(torch.optim.AdamW(ref), ref)
    _refused(sd, r"PackedAdamW.load_state_dict: param group 0: missing keys 'extra_bits', .*'decoupled'.*"
                 r"same packed optimizer class")


def test_a_packed_sgd_state_dict_is_refused_naming_betas():
    params = _params()
    sd = _stepped(PackedSGD(params, lr=0.1, momentum=0.9, extra_bits=8), params)
    _refused(sd, r"param group 0: missing keys .*'betas'")


def test_a_moment_of_the_wrong_shape_names_parameter_key_expected_and_found():
    params = _params()
    sd = _stepped(PackedAdamW(params, lr=1e-2, extra_bits=8), params)
    sd["state"][1]["exp_avg"] = torch.zeros(8)
    _refused(sd, r"state of parameter 1 \(shape \(7,\), torch.bfloat16\): key 'exp_avg' expected a tensor of "
                 r"shape \(7,\) and dtype torch.float32, got a tensor of shape \(8,\) and dtype torch.float32")


@pytest.mark.parametrize(("edit", "match"), [
    (lambda sd: sd["state"][0].__setitem__("step", torch.tensor(2.0)),
     r"parameter 0 .*key 'step' expected a non-negative Python int, got a tensor"),
    (lambda sd: sd["state"][0].pop("exp_avg_sq"), r"parameter 0 .*key 'exp_avg_sq' is missing"),
    (lambda sd: sd["state"][0].__setitem__("momentum_buffer", torch.zeros(5, 3)),
     r"parameter 0 .*key 'momentum_buffer' is not a state of this optimizer"),
    (lambda sd: sd["param_groups"][0].__setitem__("extra_bits", 5),  # 5 bits: dense int32 words, not a byte plane
     r"parameter 0 .*key 'extra' expected a tensor of shape \(\d+,\) and dtype torch.int32, got .*torch.uint8"),
    (lambda sd: sd["param_groups"][0].__setitem__("amsgrad", True), r"parameter 0 .*key 'max_exp_avg_sq' is missing"),
    (lambda sd: sd["param_groups"][0].__setitem__("lr", -1.0), r"param group 0: lr=-1.0 out of range"),
    (lambda sd: sd["param_groups"][0].__setitem__("params", [0]), r"param group 0: key 'params' lists 1 parameters"),
    (lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0])), r"state dict has 2 param groups"),
])
def test_each_difference_is_named(edit, match):
    params = _params()
    sd = _stepped(PackedAdamW(params, lr=1e-2, extra_bits=8), params)
    edit(sd)
    _refused(sd, match)


def test_a_state_dict_saved_before_amsgrad_and_maximize_existed_still_loads():
    params = _params()
    opt = PackedAdamW(params, lr=1e-2, extra_bits=8)
    sd = _stepped(opt, params)
    for g in sd["param_groups"]:
        del g["amsgrad"], g["maximize"]
    new, new_params = _target()
    new.load_state_dict(sd)
    assert new.param_groups[0]["amsgrad"] is False and new.param_groups[0]["maximize"] is False
    for p, q in zip(params, new_params, strict=True):
        assert torch.equal(new.state[q]["extra"], opt.state[p]["extra"])
