"""sc() against the plain model: outputs, gradients, BatchNorm statistics, dropout; planning."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from workbench.checkpoint import (
    STRATEGIES,
    CheckpointedSequential,
    evaluate_plan,
    plan_checkpoints,
    profile_layers,
    sc,
    units_of,
)
from workbench.measure import MemoryMeter


def small_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.3),
        nn.Conv2d(8, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
        nn.Conv2d(4, 8, 3, padding=1), nn.Dropout2d(0.2), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3),
    )


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
def test_sc_matches_baseline(strategy: str, segments: int) -> None:
    base = small_net()
    x = torch.randn(4, 3, 8, 8)
    model = sc(copy.deepcopy(base), segments=segments, strategy=strategy, sample=x)
    assert any(ckpt for _, _, ckpt in model.plan.segments)
    _assert_same(base, model, x)


def test_batchnorm_counts_once_and_dropout_is_replayed() -> None:
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


def test_lazy_planning_leaves_no_trace() -> None:
    base = small_net()
    x = torch.randn(4, 3, 8, 8)
    model = sc(copy.deepcopy(base), strategy="optimal")
    assert model.plan is None
    _assert_same(base, model, x, steps=1)  # profiling on the first batch restored BN and RNG
    assert model.plan is not None and model.plan.strategy == "optimal"


def test_profile_sizes() -> None:
    net = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 2))
    prof = profile_layers(net, torch.randn(3, 5))
    assert prof.out_bytes == [3 * 7 * 4, 3 * 7 * 4, 3 * 2 * 4]
    # Linear 1 saves its input (the sample, never counted), ReLU its output, Linear 2 its input
    assert [prof.saved_bytes(i) for i in range(3)] == [0, 84, 84]
    assert list(prof.to_frame().columns) == ["unit", "name", "time_s", "out_bytes", "saved_bytes",
                                             "forward_bytes", "backward_bytes", "grad_bytes"]
    # Linear 2's backward makes grad_input (3x7 floats) and its weight/bias grads (2x7 + 2)
    assert prof.backward_bytes[2] >= 3 * 7 * 4
    assert prof.grad_bytes == [84, 84, 24] and prof.forward_bytes[0] >= 84
    assert prof.loss_bytes >= 24  # the output gradient the loss's backward makes
    assert all(p.grad is None for p in net.parameters())  # profiling leaves no gradients


@pytest.fixture(scope="module")
def profile():
    return profile_layers(small_net(), torch.randn(4, 3, 8, 8))


def test_plans_tile_layers_and_kept_outputs(profile) -> None:
    for strategy in STRATEGIES:
        plan = plan_checkpoints(profile, segments=3, strategy=strategy)
        assert plan.segments[0][0] == 0 and plan.segments[-1][1] == len(profile)
        assert not plan.segments[-1][2]
        assert plan.kept == [b - 1 for _, b, _ in plan.segments[:-1]]
        assert (plan.predicted_peak_bytes, plan.predicted_recompute_s) == evaluate_plan(
            profile, plan.segments)


def test_no_segment_starts_at_inplace_layer(profile) -> None:
    for strategy in STRATEGIES:
        for k in range(1, len(profile) + 1):
            segs = plan_checkpoints(profile, segments=k, strategy=strategy).segments
            assert all(not profile.inplace[a] for a, _, _ in segs[1:])


def test_smallest_picks_bottleneck() -> None:
    sizes = [64, 32, 4, 32, 64]
    layers = [nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:], strict=True)]
    prof = profile_layers(layers, torch.randn(8, 64))
    plan = plan_checkpoints(prof, segments=2, strategy="smallest")
    assert plan.kept == [1]  # the 4-wide output


@settings(max_examples=25, deadline=None)
@given(frac=st.floats(0.0, 1.0), strategy=st.sampled_from(["uniform", "smallest"]))
def test_optimal_never_slower_at_same_budget(profile, frac: float, strategy: str) -> None:
    lo = plan_checkpoints(profile, strategy="optimal").predicted_peak_bytes
    hi = evaluate_plan(profile, [(0, len(profile), False)])[0]
    budget = int(lo + frac * (hi - lo))
    try:
        other = plan_checkpoints(profile, memory_budget=budget, strategy=strategy)
    except ValueError:
        return  # the heuristic has no plan at this budget; optimal may still have one
    best = plan_checkpoints(profile, memory_budget=budget, strategy="optimal")
    assert best.predicted_peak_bytes <= budget
    assert best.predicted_recompute_s <= other.predicted_recompute_s + 1e-12


def test_budget_below_minimum_raises_with_minimum(profile) -> None:
    lo = plan_checkpoints(profile, strategy="optimal").predicted_peak_bytes
    for strategy in STRATEGIES:
        with pytest.raises(ValueError, match=f"minimum achievable peak {lo} B"):
            plan_checkpoints(profile, memory_budget=lo - 1, strategy=strategy)
    assert plan_checkpoints(profile, memory_budget=lo, strategy="optimal").predicted_peak_bytes == lo


def test_bad_arguments(profile) -> None:
    with pytest.raises(ValueError, match="strategy"):
        plan_checkpoints(profile, strategy="greedy")
    with pytest.raises(ValueError, match="not both"):
        plan_checkpoints(profile, segments=2, memory_budget=10**6)
    with pytest.raises(ValueError, match=r"segments must be in \[1, 13\], got 0"):
        plan_checkpoints(profile, segments=0)
    with pytest.raises(ValueError, match="sample"):
        plan_checkpoints(small_net())
    with pytest.raises(TypeError, match="nn.Sequential"):
        sc(nn.Linear(2, 2))


def test_sc_with_memory_budget_meets_it_and_matches() -> None:
    base = small_net()
    x = torch.randn(4, 3, 8, 8)
    lo = plan_checkpoints(base, x, strategy="optimal").predicted_peak_bytes
    model = sc(copy.deepcopy(base), memory_budget=lo, strategy="optimal", sample=x)
    assert model.plan.predicted_peak_bytes <= lo and model.plan.memory_budget == lo
    _assert_same(base, model, x, steps=1)


def _tiny_resnet():
    from workbench.models import resnet18

    torch.manual_seed(0)
    return resnet18(num_classes=4, width=4)


def test_units_open_residual_blocks() -> None:
    net = _tiny_resnet()
    assert len(units_of(net, split_blocks=False)) == len(net)
    units = units_of(net)
    # each BasicBlock becomes fork + 5 body layers + merge
    assert len(units) == len(net) + 8 * 6
    x = torch.randn(2, 3, 8, 8)
    net.eval()
    state = x
    for u in units:
        state = u(state)
    torch.testing.assert_close(state, net(x), rtol=0, atol=0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sc_inside_blocks_matches_baseline(strategy: str) -> None:
    base = _tiny_resnet()
    x = torch.randn(2, 3, 8, 8)
    model = sc(copy.deepcopy(base), segments=9, strategy=strategy, sample=x)
    # some checkpoint falls strictly inside a block (its kept state is the pair skip/activation)
    inside = {i for i, u in enumerate(model.units) if type(u).__name__ in ("_Body", "_Fork")}
    if strategy != "smallest":
        assert inside & set(model.plan.kept)
    assert model.state_dict().keys() == base.state_dict().keys()
    _assert_same(base, model, x, steps=2)


def _measured(net, plan, x, loss) -> int:
    m = sc(net, 1)
    m.plan = plan
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    with MemoryMeter() as meter:
        loss(m(x)).backward()
    return meter.peak_bytes


@pytest.mark.parametrize("make", [_tiny_resnet, small_net])
def test_cost_model_never_under_predicts(make) -> None:
    net = make()
    x = torch.randn(2, 3, 8, 8)
    y = torch.tensor([0, 1])

    def loss(out):
        return nn.functional.cross_entropy(out, y)
    prof = profile_layers(net, x, loss_fn=loss, repeats=1)
    lo = plan_checkpoints(prof, strategy="optimal").predicted_peak_bytes
    hi = evaluate_plan(prof, [(0, len(prof), False)])[0]
    plans = [plan_checkpoints(prof, segments=k, strategy=s) for s in STRATEGIES for k in (1, 2, 4)]
    plans += [plan_checkpoints(prof, memory_budget=int(lo + f * (hi - lo)), strategy="optimal")
              for f in (0.0, 0.3, 0.7)]
    for plan in plans:
        measured = _measured(net, plan, x, loss)
        assert measured <= plan.predicted_peak_bytes, plan.segments
        if plan.memory_budget is not None:
            assert measured <= plan.memory_budget
    # the baseline (no checkpoint) is predicted to the byte's neighbourhood
    assert abs(_measured(net, plans[0], x, loss) - plans[0].predicted_peak_bytes) <= 64


def test_hardened_arguments(profile) -> None:
    with pytest.raises(TypeError, match=r"segments must be an int in \[1, \d+\], got 2.5"):
        sc(small_net(), 2.5)
    with pytest.raises(TypeError, match=r"segments must be an int in \[1, 13\], got '2'"):
        plan_checkpoints(profile, segments="2")
    with pytest.raises(TypeError, match="segments must be an int"):
        sc(small_net(), True)
    for bad in (float("nan"), float("inf"), -1, 0):
        with pytest.raises(ValueError, match="memory_budget must be a finite number of bytes > 0"):
            plan_checkpoints(profile, memory_budget=bad, strategy="optimal")
    with pytest.raises(ValueError, match="memory_budget must be a finite"):
        sc(small_net(), memory_budget=float("nan"))
    with pytest.raises(TypeError, match="memory_budget must be a number"):
        plan_checkpoints(profile, memory_budget="1e6")
    with pytest.raises(ValueError, match="empty layer sequence"):
        sc(nn.Sequential())
    with pytest.raises(ValueError, match="empty layer sequence"):
        plan_checkpoints(nn.Sequential(), torch.randn(1, 2))
