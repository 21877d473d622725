"""The advisor's checkpoint plans (reused across budgets as a fresh search; traces shared only between the same
programs) and its timing effort."""

import pytest
import torch
from torch import nn

from workbench.advisor.costs import Checkpoints, timing_batches
from workbench.checkpoint import evaluate_plan, plan_checkpoints, profile_layers


def _profile():
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(5) for m in (nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))],
                          nn.Linear(32, 10))
    return profile_layers(model, torch.randn(4, 32))


def test_optimal_answers_as_a_fresh_search_for_every_budget_in_any_order():
    profile = _profile()
    lowest = plan_checkpoints(profile, strategy="optimal")
    unchecked = evaluate_plan(profile, [(0, len(profile), False)])[0]
    budgets = [lowest.predicted_peak_bytes * f for f in (0.5, 0.99)]
    budgets += [lowest.predicted_peak_bytes + (unchecked - lowest.predicted_peak_bytes) * i / 7 for i in range(9)]
    for order in (budgets, budgets[::-1]):
        cached = Checkpoints(profile, uniform=[])
        for budget in order:
            if budget < lowest.predicted_peak_bytes:
                fresh = lowest.segments
            else:
                fresh = plan_checkpoints(profile, memory_budget=int(budget), strategy="optimal").segments
            assert cached.optimal(budget) == fresh, budget
        searched = len([b for b in order if b >= lowest.predicted_peak_bytes])
        if order[0] > order[-1]:  # falling budgets land inside earlier plans' intervals: fewer searches
            assert len(cached._solved) < searched


def test_a_candidate_is_its_precisions_whole_step_with_its_own_update_and_backward_hooks():
    from workbench.advisor import Config, advise

    def mlp():
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    grid = [Config(), Config(step_in_backward=True), Config("bf16", 8), Config("bf16", 16, "bf16"),
            Config("bf16", 8, step_in_backward=True)]
    advice = advise(mlp, (torch.randn(8, 16), torch.randint(0, 4, (8,))), memory_budget=2**40, candidates=grid,
                    min_run_time=0.01, calibrate=False)
    s, predicted = advice._seconds, advice.table.set_index("config")["predicted_step_seconds"]
    assert predicted["fp32"] == s["step fp32"] and predicted["bf16+8"] == s["step bf16"]
    assert predicted["fp32, step in backward"] == s["step fp32"] + s["in backward torch"]
    assert predicted["bf16+8, step in backward"] == s["step bf16"] + s["in backward packed"]
    assert predicted["bf16+16, bf16 state"] == pytest.approx(
        s["step bf16"] - s["optimizer bf16+8 fp32 state"] + s["optimizer bf16+16 bf16 state"], rel=1e-12)
    assert advice.real_runs["timed training steps"] >= 4  # two precisions, two families in backward


def test_a_step_is_timed_at_the_users_batch_where_it_fits_else_at_two_batches_below():
    assert timing_batches(lambda n: True, 32) == [32]
    assert timing_batches(lambda n: n <= 12, 32) == [6, 12]
    assert timing_batches(lambda n: n <= 1, 32) == [1]
    with pytest.raises(ValueError, match="even at batch 1"):
        timing_batches(lambda n: False, 32)


@pytest.mark.parametrize(("least_share", "groups"), [(0.5, [2, 2]), (0.6, [1, 1, 1, 1])])
def test_what_a_variant_adds_is_timed_together_with_its_plain_step_where_both_fit(monkeypatch, least_share, groups):
    from workbench.advisor import Config, advise, costs

    grid = [Config(), Config(step_in_backward=True), Config(checkpoint="uniform")]
    advice = advise(lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                                          nn.Linear(32, 4)),
                    (torch.randn(8, 16), torch.randint(0, 4, (8,))), memory_budget=2**40, candidates=grid,
                    min_run_time=0.01, calibrate=False)
    timed, real = [], costs.time_steps
    monkeypatch.setattr(costs, "time_steps", lambda fns, **kw: timed.append(len(fns)) or real(fns, **kw))
    seconds, _ = costs.measure_time(advice._workload, grid, 0.01, {}, checkpoints=advice._checkpoints,
                                    fits=lambda cfg, size, share: share >= least_share)
    # fp32 with its step in backward, then again with uniform checkpoints: two at a time where each gets half the
    # memory free, else one after the other
    assert timed == groups
    assert {"step fp32", "in backward torch", "per checkpointed segment"} <= set(seconds)
