"""The advisor's checkpoint plans (reused across budgets as a fresh search; traces shared only between the same
programs) and its timing effort."""

import time
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workbench.advisor import Config
from workbench.advisor.costs import Checkpoints, Workload, _seconds, profile_checkpoints
from workbench.calcgraph import CompiledGraph
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


class Stack(nn.Module):
    """Layers that open for checkpointing (`as_sequential`), run by a forward of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x):
        return self.body(x)

    def as_sequential(self) -> nn.Sequential:
        return self.body


def _sequential() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _workload(build) -> Workload:
    return Workload(build, torch.randn(8, 16), torch.randint(0, 4, (8,)), F.cross_entropy, "adamw", 1e-3,
                    torch.device("cpu"))


def test_a_checkpoint_plan_shares_a_trace_only_where_it_runs_that_program():
    plain = profile_checkpoints(_workload(_sequential), 4)
    unchecked = [(0, 2, False), (2, 5, False)]
    assert plain.sequential and plain.same_program(unchecked) == "none"
    assert plain.same_program(plain.uniform) == "uniform" and plain.same_program([(0, 5, True)]) is None
    own = profile_checkpoints(_workload(Stack), 4)  # its own forward: an unchecked plan is not that program
    assert not own.sequential and own.same_program(unchecked) is None and own.same_program(own.uniform) == "uniform"
    hooked = profile_checkpoints(_workload(lambda: _hooked(_sequential())), 4)
    assert not hooked.sequential


def _hooked(model: nn.Module) -> nn.Module:
    model.register_forward_hook(lambda module, args, out: out * 2)
    return model


@pytest.mark.parametrize("config", [Config(), Config("bf16", 8, "bf16", step_in_backward=True)])
def test_a_shared_trace_predicts_what_a_fresh_trace_of_the_plan_predicts(config):
    work = _workload(_sequential)
    checkpoints = profile_checkpoints(work, 4)
    cpu = torch.device("cpu")
    for segments in ([(0, 5, False)], checkpoints.uniform):
        fresh = CompiledGraph(work.program(replace(config, checkpoint="optimal"), segments=segments), device=cpu)
        same = replace(config, checkpoint=checkpoints.same_program(segments))
        shared = CompiledGraph(work.program(same), device=cpu)
        for b in (1, 8, 1000):
            np.testing.assert_array_equal(fresh.timeline(b), shared.timeline(b))
            assert fresh.required_bytes(b) == shared.required_bytes(b)
        pd.testing.assert_frame_equal(fresh.variables(8), shared.variables(8))


def test_a_call_longer_than_min_run_time_is_timed_once_after_its_warm_up():
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.03)

    seconds, counted = _seconds(slow, 0.01, torch.device("cpu"))
    assert counted == len(calls) == 2 and seconds >= 0.03
    calls.clear()
    _, counted = _seconds(lambda: calls.append(1), 0.01, torch.device("cpu"))
    assert counted >= 10  # short calls: blocks of calls (benchmark's blocked_autorange)
