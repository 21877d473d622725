"""Issue 35's hostile-input findings on the packed optimizers (``workbench.optim``), one test each, every one
failing on 012f1da: step_in_backward silently skipping parameters that became trainable later, state dicts
with a bad or fractional rounding seed or a parameter listed twice, channels_last (non-contiguous) bf16
parameters. Each is compared with what torch.optim does, or must be refused naming the bad value."""

import copy

import pytest
import torch
from torch import nn

from workbench.optim import PackedAdamW, step_in_backward

BF16 = torch.bfloat16


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).to(BF16)


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 6, generator=g).to(BF16), torch.randint(0, 3, (4,), generator=g)


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x).float(), y)


def _ordinary(model, opt, batches):
    for x, y in batches:
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()


def test_step_in_backward_updates_a_parameter_unfrozen_after_registration():
    model, twin = _mlp(), _mlp()
    for m in (model, twin):
        m[0].weight.requires_grad_(False)
    opt = PackedAdamW(model.parameters(), lr=1e-2, extra_bits=16)
    ref = PackedAdamW(twin.parameters(), lr=1e-2, extra_bits=16)
    handle = step_in_backward(model, opt)
    for m in (model, twin):
        m[0].weight.requires_grad_(True)  # unfrozen after registration (gradual unfreezing)
    batches = [_batch(1), _batch(2)]
    for x, y in batches:
        _loss(model, x, y).backward()
    _ordinary(twin, ref, batches)
    handle.remove()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert not torch.equal(model[0].weight, _mlp()[0].weight)  # it was updated


def test_step_in_backward_updates_a_layer_added_with_add_param_group():
    model, twin = _mlp(), _mlp()
    opt = PackedAdamW(model.parameters(), lr=1e-2, extra_bits=16)
    ref = PackedAdamW(twin.parameters(), lr=1e-2, extra_bits=16)
    handle = step_in_backward(model, opt)
    for m, o in ((model, opt), (twin, ref)):
        torch.manual_seed(5)
        head = nn.Linear(3, 3).to(BF16)
        m.append(head)
        o.add_param_group({"params": head.parameters()})
    batches = [_batch(1), _batch(2)]
    for x, y in batches:
        _loss(model, x, y).backward()
    _ordinary(twin, ref, batches)
    handle.remove()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_step_in_backward_refuses_a_trainable_parameter_the_optimizer_does_not_manage():
    model = _mlp()
    opt = PackedAdamW(model.parameters(), lr=1e-2, extra_bits=16)
    step_in_backward(model, opt)
    model.append(nn.Linear(3, 3).to(BF16))  # added to the model only
    x, y = _batch()
    with pytest.raises(ValueError, match=r"\['3.weight', '3.bias'\].*not in the optimizer.*add_param_group"):
        _loss(model, x, y)


def _trained():
    model = _mlp()
    opt = PackedAdamW(model.parameters(), lr=1e-2, extra_bits=7, stochastic_rounding=True, seed=11)
    _ordinary(model, opt, [_batch(1)])
    return model, opt


def _snapshot(opt):
    return copy.deepcopy({"groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
                          "state": [dict(opt.state[p]) for g in opt.param_groups for p in g["params"]],
                          "seed": opt.seed})


def _assert_unchanged(opt, before):
    after = _snapshot(opt)
    assert after["groups"] == before["groups"] and after["seed"] == before["seed"]
    for a, b in zip(after["state"], before["state"], strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]
                                            for k in a)


@pytest.mark.parametrize("seed", ["12", 1.5, True, [3]])
def test_load_state_dict_with_a_bad_seed_raises_before_changing_anything(seed):
    _, opt = _trained()
    sd = opt.state_dict()
    sd["sr_seed"] = seed
    sd["param_groups"][0]["lr"] = 0.5  # would be loaded first if the seed were checked last
    model = _mlp()
    other = PackedAdamW(model.parameters(), lr=1e-3, extra_bits=7, stochastic_rounding=True, seed=2)
    _ordinary(model, other, [_batch(3)])
    before = _snapshot(other)
    with pytest.raises(ValueError, match=r"sr_seed=.*must be an int"):
        other.load_state_dict(sd)
    _assert_unchanged(other, before)


def test_a_fractional_seed_is_refused_not_truncated():
    _, opt = _trained()
    sd = opt.state_dict()
    sd["sr_seed"] = 1.5
    for g in sd["param_groups"]:
        g["sr_seed"] = 1.5
    _, other = _trained()
    with pytest.raises(ValueError, match=r"sr_seed=1.5 \(float\)"):
        other.load_state_dict(sd)
    assert other.seed == 11


def test_duplicate_parameter_ids_are_refused():
    _, opt = _trained()
    sd = opt.state_dict()
    ids = sd["param_groups"][0]["params"]
    sd["param_groups"][0]["params"] = [ids[0], *ids[:-1]]  # the first parameter twice, the last one missing
    _, other = _trained()
    before = _snapshot(other)
    with pytest.raises(ValueError, match=r"parameter ids \[0\] are listed more than once"):
        other.load_state_dict(sd)
    _assert_unchanged(other, before)


def _conv(memory_format):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).to(memory_format=memory_format)


@pytest.mark.parametrize("fused", [False, True], ids=["per parameter", "fused"])
def test_channels_last_bf16_parameters_train_as_torch_adamw_does(fused):
    cl = torch.channels_last
    model = _conv(cl).to(BF16)
    ref = _conv(cl)  # torch.optim.AdamW on fp32 copies: bf16 + 16 extra bits is fp32
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            q.copy_(p)
    assert not model[0].weight.is_contiguous() and model[0].weight.is_contiguous(memory_format=cl)
    opt = PackedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, extra_bits=16, fused=fused)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(2, 3, 8, 8, generator=g).to(memory_format=cl)
        model(x.to(BF16)).float().square().mean().backward()
        ref(x.to(BF16).float()).square().mean().backward()
        # the same gradient for both (the bf16 model's), so the comparison is the optimizers'
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            q.grad = p.grad.float()
        opt.step()
        opt.zero_grad()
        torch_opt.step()
        torch_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.stride() == q.stride()  # still channels_last
        torch.testing.assert_close(opt.master_weight(p), q.detach(), rtol=1e-5, atol=1e-6)


def test_channels_last_step_in_backward_equals_the_ordinary_step():
    cl = torch.channels_last
    models = [_conv(cl).to(BF16) for _ in range(2)]
    opts = [PackedAdamW(m.parameters(), lr=1e-2, extra_bits=7, stochastic_rounding=True, seed=4) for m in models]
    handle = step_in_backward(models[1], opts[1])
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(2, 3, 8, 8, generator=g).to(BF16, memory_format=cl)
        for m in models:
            m(x).float().square().mean().backward()
        opts[0].step()
        opts[0].zero_grad()
    handle.remove()
    for p, q in zip(*(m.parameters() for m in models), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        torch.testing.assert_close(opts[0].master_weight(p), opts[1].master_weight(q), rtol=0, atol=0)
    sd = opts[1].state_dict()  # byte planes shown in logical indexing, and loaded back into the layout
    twin = PackedAdamW(models[0].parameters(), lr=1e-2, extra_bits=7, stochastic_rounding=True)
    twin.load_state_dict(sd)
    for p in models[0].parameters():
        assert torch.equal(twin.state[p]["extra"], opts[0].state[p]["extra"])
        assert twin.state[p]["exp_avg"].stride() == p.stride()
