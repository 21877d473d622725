"""Where checkpoints go: plans tile the units, ``smallest`` finds the bottleneck (OpTorch Fig 11),
``optimal`` is never slower at a budget, and the cost model never under-predicts a measured peak.
Tests ``workbench.checkpoint.planner``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from workbench.checkpoint import STRATEGIES, evaluate_plan, plan_checkpoints, profile_layers, sc
from workbench.measure import MemoryMeter


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


def test_bad_arguments(profile, small_net) -> None:
    with pytest.raises(ValueError, match="strategy"):
        plan_checkpoints(profile, strategy="greedy")
    with pytest.raises(ValueError, match="not both"):
        plan_checkpoints(profile, segments=2, memory_budget=10**6)
    with pytest.raises(ValueError, match=r"segments must be in \[1, 13\], got 0"):
        plan_checkpoints(profile, segments=0)
    with pytest.raises(ValueError, match="sample"):
        plan_checkpoints(small_net())


def _measured(net, plan, x, loss) -> int:
    m = sc(net, 1)
    m.plan = plan
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    with MemoryMeter() as meter:
        loss(m(x)).backward()
    return meter.peak_bytes


@pytest.mark.parametrize("make", ["tiny_resnet", "small_net"])
def test_cost_model_never_under_predicts(make, request) -> None:
    net = request.getfixturevalue(make)()
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
    with pytest.raises(TypeError, match=r"segments must be an int in \[1, 13\], got '2'"):
        plan_checkpoints(profile, segments="2")
    for bad in (float("nan"), float("inf"), -1, 0):
        with pytest.raises(ValueError, match="memory_budget must be a finite number of bytes > 0"):
            plan_checkpoints(profile, memory_budget=bad, strategy="optimal")
    with pytest.raises(TypeError, match="memory_budget must be a number"):
        plan_checkpoints(profile, memory_budget="1e6")
    with pytest.raises(ValueError, match="empty layer sequence"):
        plan_checkpoints(nn.Sequential(), torch.randn(1, 2))
