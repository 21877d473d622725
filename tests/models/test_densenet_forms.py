"""DenseNet-BC (Pleiss et al. 2017): the LuaTorch-style naive baseline, double backward through
every form, the ImageNet models and input validation. Tests ``workbench.models.densenet``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from workbench.measure import MemoryMeter
from workbench.models.densenet import IMAGENET_BLOCKS, DenseNet, densenet_bc


def _copy(base: DenseNet, **kwargs) -> DenseNet:
    model = DenseNet(**kwargs).to(next(base.parameters()).dtype)
    model.load_state_dict(base.state_dict())
    return model


def _quadratic_bytes(model: DenseNet, x_shape: tuple[int, ...]) -> int:
    """Bytes of every dense layer's concatenation (one copy), from the architecture alone."""
    n, _, h, w = x_shape
    total = 0
    for i, block in enumerate(model.blocks):
        hi, wi = h >> i, w >> i
        total += sum(n * layer.norm1.num_features * hi * wi for layer in block.layers)
    return total * 4  # float32


def test_luatorch_form_holds_both_outputs_and_both_gradients() -> None:
    torch.manual_seed(0)
    kwargs = dict(growth_rate=4, block_config=(3, 4), num_classes=3)
    base = DenseNet(**kwargs)
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([0, 2])
    live = {}
    for form in ("naive", "luatorch"):
        model = _copy(base, memory=form, **kwargs)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        with MemoryMeter("cpu") as meter:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            live[form] = meter.current_bytes  # the graph (and what it holds) is still alive
            del loss
        assert meter.end_bytes == 0, form  # everything is released with the graph
    # concat, BN output, and the gradients of both: four copies of every concatenation
    assert live["luatorch"] - live["naive"] == 4 * _quadratic_bytes(base, tuple(x.shape))


@pytest.mark.parametrize("train", [True, False])
def test_double_backward_through_every_form(train: bool) -> None:
    """A gradient penalty (backward with create_graph=True, then backward again) matches naive."""
    torch.manual_seed(0)
    kwargs = dict(growth_rate=3, block_config=(2, 2), num_classes=3)
    base = DenseNet(**kwargs).double()
    with torch.no_grad():
        for m in base.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    x0 = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    results = {}
    for form in ("naive", "luatorch", "checkpoint", "shared"):
        model = _copy(base, memory=form, **kwargs).train(train)
        x = x0.clone().requires_grad_(True)
        out = model(x)
        (gx,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
        gx.square().sum().backward()
        results[form] = (gx.detach(), [p.grad.clone() for p in model.parameters()])
    for form in ("luatorch", "checkpoint", "shared"):
        torch.testing.assert_close(results[form][0], results["naive"][0], msg=form)
        torch.testing.assert_close(results[form][1], results["naive"][1], msg=form)


def test_imagenet_models_match_published_parameter_counts() -> None:
    def count(depth: int, k: int, **kw) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in densenet_bc(depth, k, 1000, **kw).parameters())

    assert count(161, 48) == 28_681_000  # torchvision densenet161; the paper: 29M
    assert count(232, 48, imagenet=True) == 55_570_984  # the paper: 55M
    assert count(264, 32) == 33_337_704 and count(264, 48) == 72_686_632  # 33M, 73M
    assert count(201, 32) == 20_013_928  # torchvision densenet201; the paper: 20M
    with torch.device("meta"):
        assert densenet_bc(161, 48, 1000).block_config == IMAGENET_BLOCKS[161] == (6, 12, 36, 24)
        assert densenet_bc(232, 48, 1000, imagenet=True).block_config == (6, 12, 48, 48)
        assert densenet_bc(232).block_config == (38, 38, 38)  # 232 = 6 * 38 + 4 is also CIFAR
        assert densenet_bc(232, imagenet=True).small_inputs is False
        assert densenet_bc(100, imagenet=False).depth == 100


def test_imagenet_161_trains_one_step_at_a_small_size() -> None:
    torch.manual_seed(0)
    model = densenet_bc(161, 4, 5, memory="shared", shared_buffer="max")  # k=4 keeps it small
    out = model(torch.randn(2, 3, 32, 32))  # the last block sees 1x1 maps: BN needs 2 samples
    out.sum().backward()
    assert out.shape == (2, 5) and all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("call, exc, match", [
    (lambda: densenet_bc("100"), TypeError, "depth='100'"),
    (lambda: densenet_bc(100.0), TypeError, "depth=100.0"),
    (lambda: densenet_bc(True), TypeError, "depth=True"),
    (lambda: densenet_bc(100, "12"), TypeError, "growth_rate='12'"),
    (lambda: densenet_bc(100, 12, 10.5), TypeError, "num_classes=10.5"),
    (lambda: densenet_bc(100, imagenet="yes"), TypeError, "imagenet='yes'"),
    (lambda: densenet_bc(100, imagenet=True), ValueError, r"depth=100 with imagenet=True; allowed: \[121"),
    (lambda: densenet_bc(0), ValueError, "depth=0; must be >= 1"),
    (lambda: densenet_bc(17), ValueError, "depth=17; allowed: 6n\\+4"),
    (lambda: densenet_bc(100, memory=3), TypeError, "memory=3"),
    (lambda: densenet_bc(100, memory="lua"), ValueError, "memory='lua'; allowed"),
    (lambda: densenet_bc(100, shared_buffer="huge"), ValueError, "shared_buffer='huge'; allowed"),
    (lambda: DenseNet(12, "abc"), TypeError, "block_config='abc'"),
    (lambda: DenseNet(12, (2, 2.5)), TypeError, "block_config entry=2.5"),
    (lambda: DenseNet(12, (2, 0)), ValueError, "block_config entry=0; must be >= 1"),
    (lambda: DenseNet(12, compression="0.5"), TypeError, "compression='0.5'"),
    (lambda: DenseNet(12, bottleneck=1), TypeError, "bottleneck=1"),
    (lambda: DenseNet(12, bn_size=0), ValueError, "bn_size=0"),
    (lambda: setattr(densenet_bc(10), "shared_buffer", "x"), ValueError, "shared_buffer='x'"),
])
def test_bad_input_raises_early_naming_value_and_range(call, exc, match) -> None:
    with pytest.raises(exc, match=match):
        call()


def test_luatorch_form_without_grad_holds_nothing_after_forward() -> None:
    model = densenet_bc(10, 4, 3, memory="luatorch").eval()
    with torch.no_grad(), MemoryMeter("cpu") as meter:
        out = model(torch.randn(1, 3, 8, 8))
    assert meter.end_bytes == out.untyped_storage().nbytes()
    assert math.isfinite(float(out.sum()))
