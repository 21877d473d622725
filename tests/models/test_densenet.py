"""DenseNet-BC memory forms (Pleiss et al. 2017): the checkpointed and shared-storage forms are
switches on the naive baseline and must match it (outputs, gradients, BN running statistics).
Tests ``workbench.models.densenet``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.models.densenet import FORMS, IMAGENET_BLOCKS, DenseNet, bc_depths, densenet_bc
from densenet_cases import randomize_bn
from tests.conftest import requires_cuda


def _run(model: DenseNet, x: torch.Tensor, *, steps: int = 1):
    """`steps` training (or eval) steps on x; returns output, input grad, grads, state dict."""
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_(True)
        out = model(xg)
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view_as(out)
        (out * weights).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return out.detach(), xg.grad, grads, {k: v.clone() for k, v in model.state_dict().items()}



def _forms_from(base: DenseNet, **kwargs) -> dict[str, DenseNet]:
    models = {}
    for form in FORMS:
        m = DenseNet(memory=form, **kwargs).to(next(base.parameters()).dtype)
        m.load_state_dict(base.state_dict())
        models[form] = m
    return models


def _assert_same(results: dict, **tol) -> None:
    ref = results["naive"]
    for form in FORMS[1:]:
        got = results[form]
        torch.testing.assert_close(got[0], ref[0], **tol, msg=f"{form}: output")
        torch.testing.assert_close(got[1], ref[1], **tol, msg=f"{form}: input grad")
        torch.testing.assert_close(got[2], ref[2], **tol, msg=f"{form}: parameter grads")
        torch.testing.assert_close(got[3], ref[3], **tol, msg=f"{form}: state (BN stats)")


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_forms_match_naive(train: bool, dtype: torch.dtype) -> None:
    kwargs = dict(growth_rate=4, block_config=(2, 3), num_classes=5)
    torch.manual_seed(0)
    base = randomize_bn(DenseNet(**kwargs).to(dtype))
    x = torch.randn(3, 3, 8, 8, dtype=dtype)
    results = {}
    for form, model in _forms_from(base, **kwargs).items():
        results[form] = _run(model.train(train), x, steps=2)
    tol = {} if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    _assert_same(results, **tol)


def test_running_stats_advance_once_per_step() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, 8)
    for form in FORMS:
        torch.manual_seed(0)
        model = densenet_bc(10, 4, 3, memory=form).train()
        before = model.blocks[0].layers[0].norm1.running_mean.clone()
        _run(model, x, steps=3)
        norm = model.blocks[0].layers[0].norm1
        assert int(norm.num_batches_tracked) == 3, form
        # three momentum-0.1 updates towards the same batch mean (no optimizer step, so the
        # stem output is the same each time): 1 - 0.9**3 of the way, not 1 - 0.9**6
        with torch.no_grad():
            batch_mean = model.stem(x).mean(dim=(0, 2, 3))
        expected = before + (1 - 0.9**3) * (batch_mean - before)
        torch.testing.assert_close(norm.running_mean, expected, rtol=1e-4, atol=1e-5)


@settings(max_examples=8, deadline=None)
@given(growth=st.integers(1, 5), blocks=st.lists(st.integers(1, 3), min_size=1, max_size=3),
       bottleneck=st.booleans(), batch=st.integers(2, 3), size=st.sampled_from([4, 6, 8]),
       train=st.booleans(), small=st.booleans())
def test_forms_match_naive_property(growth, blocks, bottleneck, batch, size, train,
                                    small) -> None:
    size = size if small else 4 * size
    if 2 ** (len(blocks) - 1) > size // (1 if small else 4):
        blocks = blocks[:1]
    kwargs = dict(growth_rate=growth, block_config=tuple(blocks), bottleneck=bottleneck,
                  num_classes=3, small_inputs=small, compression=0.5 if bottleneck else 1.0)
    base = randomize_bn(DenseNet(**kwargs).double())
    x = torch.randn(batch, 3, size, size, dtype=torch.float64)
    results = {f: _run(m.train(train), x) for f, m in _forms_from(base, **kwargs).items()}
    _assert_same(results)


def test_state_dicts_interchangeable_and_memory_switch() -> None:
    keys = {f: list(densenet_bc(16, memory=f).state_dict()) for f in FORMS}
    assert keys["naive"] == keys["checkpoint"] == keys["shared"]
    model = densenet_bc(16, 4, 3)
    model.memory = "shared"
    assert {layer.memory for b in model.blocks for layer in b.layers} == {"shared"}


def test_architecture_matches_published_sizes() -> None:
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(densenet_bc(121, 32, 1000)) == 7_978_856  # torchvision densenet121
    model = densenet_bc(100, 12, 10)
    assert model.depth == 100 and model.block_config == (16, 16, 16)
    assert 0.7e6 < count(model) < 0.85e6  # Huang et al.: DenseNet-BC L=100, k=12: 0.8M
    assert 1.6e6 < count(densenet_bc(160, 12, 10)) < 1.9e6  # paper Section 5: 1.8M
    assert densenet_bc(169, 32, 1000).block_config == IMAGENET_BLOCKS[169]
    assert bc_depths(40) == [10, 16, 22, 28, 34, 40]


@pytest.mark.parametrize("call, match", [
    (lambda: densenet_bc(17), "depth=17"),
    (lambda: densenet_bc(100, memory="fast"), "memory='fast'"),
    (lambda: DenseNet(0), "growth_rate=0"),
    (lambda: DenseNet(12, ()), "block_config"),
    (lambda: DenseNet(12, (2,), compression=1.5), "compression=1.5"),
    (lambda: setattr(densenet_bc(10), "memory", "x"), "memory='x'"),
])
def test_bad_input_raises_with_value(call, match) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_no_grad_inference_matches() -> None:
    torch.manual_seed(0)
    base = densenet_bc(16, 4, 3).eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        ref = base(x)
        for form in FORMS[1:]:
            base.memory = form
            torch.testing.assert_close(base(x), ref)
    assert F.softmax(ref, 1).shape == (2, 3)


@requires_cuda
def test_forms_match_naive_on_cuda() -> None:
    kwargs = dict(growth_rate=4, block_config=(2, 3), num_classes=5)
    torch.manual_seed(0)
    base = randomize_bn(DenseNet(**kwargs)).double()
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    results = {f: _run(m.cuda().train(), x.cuda(), steps=2)
               for f, m in _forms_from(base, **kwargs).items()}
    _assert_same(results)
