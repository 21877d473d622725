"""Issue 43's hostile-input findings on the packed optimizers' state, one test each, every one failing on
4414cd0: a parameter resized through ``.data`` after a step, a model converted after bf16 steps, an fp16+8
state dict loaded under bf16 parameters, and string switches ('False', 'no') taken as True. Each is compared
with torch.optim.AdamW where it refuses, or must be refused naming the bad value; nothing is changed first."""

import copy

import pytest
import torch
from torch import nn

from workbench.optim import PackedAdamW, PackedSGD, step_in_backward

BF16 = torch.bfloat16


def _stepped(dtype=BF16, **options):
    torch.manual_seed(0)
    model = nn.Linear(4, 4).to(dtype)
    opt = PackedAdamW(model.parameters(), extra_bits=8, **options)
    model(torch.randn(2, 4, dtype=dtype)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("fused", [False, True])
def test_a_parameter_resized_through_data_after_a_step_is_refused_as_torch_does(fused):
    model, opt = _stepped(fused=fused)
    ref = nn.Linear(4, 4)
    torch_opt = torch.optim.AdamW(ref.parameters())
    ref(torch.randn(2, 4)).sum().backward()
    torch_opt.step()
    for m in (model, ref):
        m.weight.data = torch.randn(8, 4, dtype=m.weight.dtype)
        m.weight.grad = torch.randn(8, 4, dtype=m.weight.dtype)
        m.bias.grad = torch.randn(4, dtype=m.bias.dtype)
    with pytest.raises(RuntimeError):
        torch_opt.step()
    before = {k: v.clone() for k, v in opt.state[model.bias].items() if torch.is_tensor(v)}
    with pytest.raises(RuntimeError, match=r"shape \(8, 4\) now.*made for shape \(4, 4\)"):
        opt.step()
    assert all(torch.equal(before[k], v) for k, v in opt.state[model.bias].items() if torch.is_tensor(v))


@pytest.mark.parametrize("convert, now", [(nn.Module.half, "torch.float16"), (nn.Module.float, "torch.float32")])
def test_a_model_converted_after_bf16_steps_is_refused_naming_both_dtypes(convert, now):
    model, opt = _stepped()
    convert(model)
    model(torch.randn(2, 4, dtype=model.weight.dtype)).sum().backward()
    with pytest.raises(RuntimeError, match=rf"is {now} now.*made for torch.bfloat16"):
        opt.step()


def test_converted_back_it_steps_again():
    model, opt = _stepped()
    model.half()
    model.bfloat16()  # the same values: bf16 -> fp16 -> bf16 is exact for these small weights
    model(torch.randn(2, 4, dtype=BF16)).sum().backward()
    opt.step()
    assert opt.state[model.weight]["step"] == 2


def test_step_in_backward_refuses_a_converted_model_too():
    model, opt = _stepped()
    step_in_backward(model, opt)
    model.half()
    with pytest.raises(RuntimeError, match="is torch.float16 now"):
        model(torch.randn(2, 4, dtype=torch.float16)).sum().backward()


def test_an_fp16_state_dict_is_refused_under_bf16_parameters():
    _, opt = _stepped(torch.float16)
    saved = opt.state_dict()
    assert saved["param_groups"][0]["param_dtypes"] == ["float16", "float16"]
    model = nn.Linear(4, 4).to(BF16)
    other = PackedAdamW(model.parameters(), extra_bits=8)
    with pytest.raises(ValueError, match=r"saved for float16 parameters and this one is torch.bfloat16"):
        other.load_state_dict(saved)
    assert not other.state  # nothing loaded
    same = PackedAdamW(nn.Linear(4, 4).half().parameters(), extra_bits=8)
    same.load_state_dict(copy.deepcopy(saved))  # the dtype it was saved with loads
    assert "param_dtypes" not in same.param_groups[0]


def test_a_state_dict_saved_before_dtypes_were_recorded_still_loads():
    _, opt = _stepped()
    saved = opt.state_dict()
    for g in saved["param_groups"]:
        del g["param_dtypes"]
    PackedAdamW(nn.Linear(4, 4).to(BF16).parameters(), extra_bits=8).load_state_dict(saved)


@pytest.mark.parametrize("make, key, value", [
    (lambda p, **kw: PackedAdamW(p, extra_bits=8, **kw), "maximize", "False"),
    (lambda p, **kw: PackedAdamW(p, extra_bits=8, **kw), "amsgrad", "no"),
    (lambda p, **kw: PackedAdamW(p, extra_bits=8, **kw), "stochastic_rounding", 2),
    (lambda p, **kw: PackedSGD(p, lr=0.1, momentum=0.9, extra_bits=8, **kw), "nesterov", "yes"),
])
def test_a_switch_that_is_not_a_bool_is_refused_naming_it(make, key, value):
    params = nn.Linear(4, 4).to(BF16).parameters()
    with pytest.raises(TypeError, match=rf"{key}={value!r} must be True or False"):
        make(params, **{key: value})


def test_a_switch_set_by_hand_in_a_group_is_refused_when_the_group_is_added():
    model = nn.Linear(4, 4).to(BF16)
    opt = PackedAdamW([model.weight], extra_bits=8)
    with pytest.raises(TypeError, match="maximize='True' must be True or False"):
        opt.add_param_group({"params": [model.bias], "maximize": "True"})
    assert len(opt.param_groups) == 1


def test_betas_given_as_one_number_is_refused_naming_betas():
    with pytest.raises(TypeError, match=r"betas=0.9 must be a pair"):
        PackedAdamW(nn.Linear(4, 4).to(BF16).parameters(), betas=0.9, extra_bits=8)


def test_a_parameter_listed_twice_is_refused_naming_both_indices(recwarn):
    model = nn.Linear(4, 4).to(BF16)
    with pytest.raises(ValueError, match=r"parameter 1 of group 0 \(shape \(4, 4\)\) is parameter 0 again"):
        PackedAdamW([model.weight, model.weight], extra_bits=8)
    assert not [w for w in recwarn.list if "duplicate" in str(w.message)]  # refused, not warned then run


def test_an_option_edited_by_hand_in_a_group_is_checked_at_the_next_step():
    model, opt = _stepped()
    opt.param_groups[0]["extra_bits"] = 20
    model(torch.randn(2, 4, dtype=BF16)).sum().backward()
    with pytest.raises(ValueError, match=r"extra_bits=20 out of range for torch.bfloat16: allowed 0\.\.16"):
        opt.step()
    opt.param_groups[0]["extra_bits"] = 8  # put back, it steps
    opt.step()
    assert opt.state[model.weight]["step"] == 2


def test_sparse_gradients_are_refused_as_torch_does():
    torch.manual_seed(0)
    emb, ref = nn.Embedding(10, 4, sparse=True).to(BF16), nn.Embedding(10, 4, sparse=True)
    for m, opt in ((emb, PackedAdamW(emb.parameters(), extra_bits=8)), (ref, torch.optim.AdamW(ref.parameters()))):
        m(torch.tensor([1, 2])).sum().backward()
        with pytest.raises(RuntimeError, match="does not support sparse gradients"):
            opt.step()


def test_step_in_backward_refuses_a_non_module_and_a_second_registration():
    model, opt = _stepped()
    with pytest.raises(TypeError, match="model must be an nn.Module .*got Parameter"):
        step_in_backward(model.weight, opt)
    handle = step_in_backward(model, opt)
    with pytest.raises(ValueError, match="already registered on 2 of this model's parameters"):
        step_in_backward(model, opt)
    handle.remove()
    step_in_backward(model, opt).remove()  # once removed, it registers again
