"""The shared-storage autograd Function of DenseNet-BC (Pleiss et al. 2017, Section 4): gradients
and second derivatives by finite differences, autocast, and the one max-size pair of storages.
Tests ``workbench.models.densenet_shared``."""

from __future__ import annotations

import pytest
import torch

from workbench.measure import MemoryMeter
from workbench.models.densenet import DenseNet, densenet_bc
from densenet_cases import randomize_bn



def _copy(base: DenseNet, **kwargs) -> DenseNet:
    model = DenseNet(**kwargs).to(next(base.parameters()).dtype)
    model.load_state_dict(base.state_dict())
    return model


@pytest.mark.parametrize("train", [True, False])
def test_shared_function_gradcheck(train: bool) -> None:
    torch.manual_seed(0)
    model = randomize_bn(DenseNet(2, (3,), num_classes=2, memory="shared").double())
    model.train(train)
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    layer = model.blocks[0].layers[1]  # the Function's own inputs: two features, BN, conv
    params = [layer.norm1.weight, layer.norm1.bias, layer.conv1.weight]

    def f(inp, *ps):
        return model(inp)

    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-5, fast_mode=True)


def test_shared_function_gradgradcheck() -> None:
    torch.manual_seed(0)
    model = DenseNet(2, (2,), num_classes=2, memory="shared").double()
    layer = model.blocks[0].layers[1]
    params = (layer.norm1.weight, layer.conv1.weight)
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda inp, *ps: model(inp), (x, *params), atol=1e-5,
                                        fast_mode=True)


def test_shared_form_runs_under_autocast() -> None:
    torch.manual_seed(0)
    base = densenet_bc(16, 4, 5)
    x = torch.randn(2, 3, 8, 8)

    def grads(form: str, autocast: bool) -> torch.Tensor:
        model = densenet_bc(16, 4, 5, memory=form)
        model.load_state_dict(base.state_dict())
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        out.float().square().sum().backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    ref = grads("naive", False)
    err = {f: ((grads(f, True) - ref).norm() / ref.norm()).item() for f in ("naive", "shared")}
    # shared computes conv1 in float32 where naive uses bfloat16: no further from float32
    assert err["shared"] <= 1.5 * err["naive"], err


def _peak(model: DenseNet, x: torch.Tensor) -> int:
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with MemoryMeter("cpu") as meter:
        model(x).square().sum().backward()
    return meter.peak_bytes


def test_max_buffer_is_one_pair_of_the_largest_size() -> None:
    torch.manual_seed(0)
    kwargs = dict(growth_rate=4, block_config=(3, 3, 3), num_classes=3)
    base = DenseNet(**kwargs)
    x = torch.randn(2, 3, 8, 8)
    model = _copy(base, memory="shared", shared_buffer="max", **kwargs)
    state = model._step_state(model.stem(x))
    # the first block is the widest: (2k + 2 * k) channels at 8x8
    expected = max(2 * (b.in_channels + 2 * 4) * (8 >> i) * (8 >> i) for i, b in enumerate(model.blocks))
    assert state.concat.numel() == state.normed.numel() == expected == 2 * 16 * 64
    assert not state.per_block
    peaks = {buf: _peak(_copy(base, memory="shared", shared_buffer=buf, **kwargs), x)
             for buf in ("per_block", "max")}
    assert peaks["per_block"] < peaks["max"]
    # the max form's peak never exceeds the per-block one by more than that pair of buffers
    assert peaks["max"] - peaks["per_block"] <= 2 * expected * 4


@pytest.mark.parametrize("train", [True, False])
def test_max_buffer_matches_naive(train: bool) -> None:
    torch.manual_seed(0)
    kwargs = dict(growth_rate=3, block_config=(2, 3), num_classes=4)
    base = DenseNet(**kwargs).double()
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    results = []
    for kw in (dict(memory="naive"), dict(memory="shared", shared_buffer="max")):
        model = _copy(base, **kw, **kwargs).train(train)
        out = model(x)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        results.append((out.detach(), [p.grad for p in model.parameters()], model.state_dict()))
    torch.testing.assert_close(results[1][0], results[0][0])
    torch.testing.assert_close(results[1][1], results[0][1])
    torch.testing.assert_close(results[1][2], results[0][2])
    model.shared_buffer = "per_block"
    assert "shared_buffer='per_block'" in repr(model)
