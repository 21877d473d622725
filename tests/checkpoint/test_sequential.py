"""sc() against the plain model: outputs, gradients, BatchNorm statistics, dropout (OpTorch, Sec.
II-B-2, ``scmodel = sc(model)``). Tests ``workbench.checkpoint.sequential``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from workbench.checkpoint import STRATEGIES, CheckpointedSequential, plan_checkpoints, sc


def _step(model: nn.Module, x: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    y = model(x)
    (y * torch.arange(1.0, y.shape[1] + 1)).sum().backward()
    return y.detach()


def _assert_same(base: nn.Module, ckpt: nn.Module, x: torch.Tensor, steps: int = 2) -> None:
    for seed in range(steps):
        torch.testing.assert_close(_step(ckpt, x, seed), _step(base, x, seed))
    for (name, p), q in zip(base.named_parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    for (name, b), c in zip(base.named_buffers(), ckpt.buffers(), strict=True):
        torch.testing.assert_close(c, b, msg=name)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("segments", [2, 4])
def test_sc_matches_baseline(strategy: str, segments: int, small_net) -> None:
    base = small_net()
    x = torch.randn(4, 3, 8, 8)
    model = sc(copy.deepcopy(base), segments=segments, strategy=strategy, sample=x)
    assert any(ckpt for _, _, ckpt in model.plan.segments)
    _assert_same(base, model, x)


def test_batchnorm_counts_once_and_dropout_is_replayed(small_net) -> None:
    base = small_net()
    x = torch.randn(4, 3, 8, 8)
    model = sc(copy.deepcopy(base), segments=len(base))  # every layer recomputed
    _assert_same(base, model, x, steps=3)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert [int(b.num_batches_tracked) for b in bns] == [3, 3]


def test_sc_on_resnet_shares_parameters_and_state_dict() -> None:
    from workbench.models import resnet18

    torch.manual_seed(0)
    base = resnet18(num_classes=4)
    model = sc(base, segments=3)
    assert isinstance(model, CheckpointedSequential)
    assert model.state_dict().keys() == base.state_dict().keys()
    assert all(p is q for p, q in zip(model.parameters(), base.parameters(), strict=True))
    ref = copy.deepcopy(base)
    x = torch.randn(2, 3, 8, 8)
    _assert_same(ref, model, x, steps=1)
    model.eval()
    ref.eval()
    torch.testing.assert_close(model(x), ref(x))


def test_lazy_planning_leaves_no_trace(small_net) -> None:
    base = small_net()
    x = torch.randn(4, 3, 8, 8)
    model = sc(copy.deepcopy(base), strategy="optimal")
    assert model.plan is None
    _assert_same(base, model, x, steps=1)  # profiling on the first batch restored BN and RNG
    assert model.plan is not None and model.plan.strategy == "optimal"


def test_sc_with_memory_budget_meets_it_and_matches(small_net) -> None:
    base = small_net()
    x = torch.randn(4, 3, 8, 8)
    lo = plan_checkpoints(base, x, strategy="optimal").predicted_peak_bytes
    model = sc(copy.deepcopy(base), memory_budget=lo, strategy="optimal", sample=x)
    assert model.plan.predicted_peak_bytes <= lo and model.plan.memory_budget == lo
    _assert_same(base, model, x, steps=1)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sc_inside_blocks_matches_baseline(strategy: str, tiny_resnet) -> None:
    base = tiny_resnet()
    x = torch.randn(2, 3, 8, 8)
    model = sc(copy.deepcopy(base), segments=9, strategy=strategy, sample=x)
    # some checkpoint falls strictly inside a block (its kept state is the pair skip/activation)
    inside = {i for i, u in enumerate(model.units) if type(u).__name__ in ("_Body", "_Fork")}
    if strategy != "smallest":
        assert inside & set(model.plan.kept)
    assert model.state_dict().keys() == base.state_dict().keys()
    _assert_same(base, model, x, steps=2)


def test_bad_and_hardened_arguments(small_net) -> None:
    with pytest.raises(TypeError, match="nn.Sequential"):
        sc(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"segments must be an int in \[1, \d+\], got 2.5"):
        sc(small_net(), 2.5)
    with pytest.raises(TypeError, match="segments must be an int"):
        sc(small_net(), True)
    with pytest.raises(ValueError, match="memory_budget must be a finite"):
        sc(small_net(), memory_budget=float("nan"))
    with pytest.raises(ValueError, match="empty layer sequence"):
        sc(nn.Sequential())
