"""A plain program's line checked by its calibration's real runs, not by a third trace (issue 45): fitted at batches
2 and 3, its allocations must be on that line at every batch the calibration ran (4 and 8), or it is traced at 4 as
before. Each verdict must be the third trace's: the same plans where the line holds, the same program found not affine
where it does not."""

import numpy as np
import pytest
import torch
from torch import nn

from workbench.advisor import Config
from workbench.advisor.plans import Plans
from workbench.advisor.workload import Workload
from workbench.calcgraph import plan_training
from workbench.calcgraph.derive import StepTracer

from tests.advisor.test_derive import MODELS

pytestmark = pytest.mark.usefixtures("one_thread")

GRID = [Config(), Config(step_in_backward=True), Config("amp_bf16")]


class Pairwise(nn.Module):
    """A batch's examples compared with each other: a [batch, batch] tensor, memory quadratic in the batch (off the
    line through batches 2 and 3: 16 and 36 bytes, 56 predicted at 4 where it takes 64)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + (x @ x.T).mean(dim=1, keepdim=True)


def _plans(build, shape, checked: bool) -> Plans:
    x, y = torch.randn(4, *shape), torch.randint(0, 5, (4,))
    work = Workload.of(build, x, y, None, "adamw", 1e-3, torch.device("cpu"))
    plans = Plans(work, GRID, checked_by_calibration=checked)
    for cfg in GRID:
        plans.graph(cfg)
    for precision in dict.fromkeys(Config(c.precision) for c in GRID):
        plans.calibrate(precision, 4)
    plans.plan(Config())  # where calibration did not show a line, a trace checks it now
    return plans


@pytest.mark.parametrize("name", ["cnn", "attention"])
def test_where_the_real_runs_hold_the_line_the_plans_are_those_checked_by_a_trace(name):
    build, shape = MODELS[name]
    checked, traced = _plans(build, shape, True), _plans(build, shape, False)
    for cfg in GRID:
        a, b = checked.graph(cfg), traced.graph(cfg)
        assert a.affine and b.affine, cfg.name
        for size in (3, 6, 17, 64):
            np.testing.assert_array_equal(a._planned_sizes(size), b._planned_sizes(size))
    for precision, (_, calibrated) in checked._calibrated.items():
        assert calibrated.calibration.line_held, precision
    assert not checked._unchecked
    assert checked.traces == traced.traces - 2  # no trace at batch 4 for either precision's plain program


def test_where_a_size_leaves_the_line_the_program_is_traced_at_4_and_found_not_affine():
    checked, traced = _plans(lambda: Pairwise(), (24,), True), _plans(lambda: Pairwise(), (24,), False)
    for cfg in GRID:
        a, b = checked.graph(cfg), traced.graph(cfg)
        assert not a.affine and not b.affine, cfg.name  # step in backward: compiled again from the plain program
        assert a.nonaffine.to_dict("records") == b.nonaffine.to_dict("records"), cfg.name
        for size in (5, 9):
            assert checked.plan(cfg).peak(size) == traced.plan(cfg).peak(size), (cfg.name, size)
    assert not checked._calibrated and not traced._calibrated  # a program not affine is not calibrated
    assert "mm.default" in set(checked.graph(Config()).nonaffine["op"])


def test_without_the_allocators_events_the_line_is_checked_by_the_trace():
    build, shape = MODELS["cnn"]
    x, y = torch.randn(4, *shape), torch.randint(0, 5, (4,))
    plans = Plans(Workload.of(build, x, y, None, "adamw", 1e-3, torch.device("cpu")), [Config()],
                  checked_by_calibration=True)
    assert sorted(plans.graph(Config())._exact) == [2, 3]
    plans.no_allocator_events = True  # as after calibration found none
    assert plans.calibrate(Config(), 4) == 0 and plans._unchecked
    plans.plan(Config())
    assert sorted(plans.graph(Config())._exact) == [2, 3, 4] and not plans._unchecked


def test_a_plan_fitted_at_two_batches_checked_later_is_the_plan_checked_at_once():
    x = torch.randn(4, 24)
    for model, affine in ((Pairwise(), False), (nn.Sequential(nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 5)), True)):
        late = plan_training(model, x, trace_sizes=(2, 3), calibrate=False)
        now = plan_training(model, x, trace_sizes=(2, 3, 4), calibrate=False)
        assert late.affine and late.check(4) is affine and now.affine is affine
        assert late.nonaffine.to_dict("records") == now.nonaffine.to_dict("records")
        assert late.required_bytes(7) == now.required_bytes(7)


def test_the_lines_calibration_left_unchecked_are_traced_side_by_side(monkeypatch):
    import os

    from workbench.calcgraph.forked import ENV

    traced = StepTracer.__call__

    def marked(tracer, size):  # each trace says which process made it
        trace = traced(tracer, size)
        trace.made_by = os.getpid()
        return trace
    monkeypatch.setattr(StepTracer, "__call__", marked)
    monkeypatch.setenv(ENV, "2")
    plans = _plans(lambda: Pairwise(), (24,), True)  # neither precision's line shown: both checked at 4
    made = [plans.graph(Config(p))._exact[4] for p in ("fp32", "amp_bf16")]
    assert all(getattr(t, "made_by", os.getpid()) != os.getpid() for t in made)


class Positions(nn.Module):
    """Token ids in, and positions the model makes itself with an `arange` (as GPT-2's): the real run picks its rows
    of the user's batch with an `arange` too, which calibration must not take for the model's."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions, self.fc = nn.Embedding(16, 8), nn.Embedding(6, 8), nn.Linear(8, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = self.positions(torch.arange(ids.shape[1], device=ids.device))  # before the tokens, as GPT-2's
        return self.fc((self.tokens(ids) + positions).mean(dim=1))


@pytest.mark.parametrize("cfg", [Config(), Config("bf16", extra_bits=8)], ids=lambda c: c.name)
def test_a_model_making_its_own_positions_holds_the_line_through_its_real_runs(cfg):
    x, y = torch.randint(0, 16, (4, 6)), torch.randint(0, 5, (4,))
    plans = {checked: Plans(Workload.of(Positions, x, y, None, "adamw", 1e-3, torch.device("cpu")), [cfg],
                            checked_by_calibration=checked) for checked in (True, False)}
    for each in plans.values():
        each.graph(cfg)
        each.calibrate(cfg, 4)
    calibrated = plans[True]._calibrated[cfg.precision][1]
    assert calibrated.calibration.line_held and not plans[True]._unchecked
    assert plans[True].traces == plans[False].traces - 1  # no trace at batch 4
    for size in (3, 17, 64):
        assert plans[True].plan(cfg).peak(size) == plans[False].plan(cfg).peak(size), size
