"""A step made again (issue 45): a program's second step runs the first's calls on the same shapes, less what the
first made to keep (the optimizer's state), so the advisor traces one step and makes the second from it
(`calcgraph.derive.repeat_step`), as each precision's first two-step trace shows it may (`repeat_rule`). The trace it
makes must be the two-step trace, field by field; where a program's second step is not its first made again, both
steps are traced."""

import numpy as np
import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from workbench.advisor import Config
from workbench.advisor.plans import Plans
from workbench.advisor.workload import Workload
from workbench.calcgraph import CompiledGraph
from workbench.calcgraph import derive
from workbench.calcgraph.calibrate import observe
from workbench.calcgraph.derive import repeat_rule, repeat_step
from workbench.calcgraph.forked import trace_program

from tests.advisor.test_derive import MODELS

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIGS = [Config(), Config("amp_bf16"), Config("bf16", 8), Config(step_in_backward=True),
           Config(checkpoint="uniform"), Config("bf16", 8, step_in_backward=True, checkpoint="uniform")]
FIELDS = ("info", "marks", "call_marks", "calls", "keys", "sources", "signature", "spec")


def _work(build, shape) -> Workload:
    x = torch.randn(4, *shape)
    return Workload.of(build, x, torch.randint(0, 5, (4,)), None, "adamw", 1e-3, torch.device("cpu"))


def _assert_same(made, traced) -> None:
    np.testing.assert_array_equal(made.sizes, traced.sizes)
    np.testing.assert_array_equal(made.events, traced.events)
    for name in FIELDS:
        assert getattr(made, name) == getattr(traced, name), name


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_a_step_made_again_is_the_traced_second_step(model, cfg):
    work = _work(*MODELS[model])
    both = trace_program(work.program(cfg), 3, work.device)
    renewed = repeat_rule(both)
    # torch's AdamW keeps only its state; the packed optimizer also renews its cached coefficients every step
    assert renewed is (cfg.precision == "bf16")
    _assert_same(repeat_step(trace_program(work.program(cfg, steps=1), 3, work.device), renewed), both)
    if cfg.checkpoint != "none":
        assert any(info.get("recomputed") and info["phase"] == "step2" for info in both.info)


class EveryOther(nn.Module):
    """Copies its input on every second call: its second step is not its first."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.calls = nn.Linear(6, 5), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x.clone() if self.calls % 2 == 0 else x)


class KeepsLast(nn.Module):
    """Keeps a copy of its last input: step 2 makes one and frees step 1's."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.last = nn.Linear(6, 5), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = x.detach().clone()
        return self.linear(x)


class CachesOnce(nn.Module):
    """Makes a table on its first call and keeps it: step 2 does not make it again."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.table = nn.Linear(6, 5), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.ones(6)
        return self.linear(x * self.table)


@pytest.mark.parametrize("build, renewed", [(EveryOther, None), (KeepsLast, True), (CachesOnce, False)])
def test_a_plan_traces_one_step_only_where_the_second_is_the_first_made_again(build, renewed, monkeypatch):
    work = _work(build, (6,))
    traced_steps = []

    def counted(program, size, device):
        traced_steps.append(1 if program is one_step else 2)
        return trace_program(program, size, device)
    monkeypatch.setattr(derive, "trace_program", counted)
    one_step = work.program(Config(), steps=1)
    graph = CompiledGraph(work.program(Config()), device="cpu", trace_sizes=(2, 3, 4), one_step=one_step)
    assert graph._tracer.renewed is renewed
    assert traced_steps == ([2, 2, 2] if renewed is None else [2, 1, 1])
    for size in (2, 3, 4):
        _assert_same(graph._exact[size], trace_program(work.program(Config()), size, work.device))
    alone = CompiledGraph(work.program(Config()), device="cpu", trace_sizes=(2, 3, 4))
    assert [graph.required_bytes(b) for b in (1, 5, 17, 64)] == [alone.required_bytes(b) for b in (1, 5, 17, 64)]


def test_the_advisors_plans_are_made_from_one_step_and_equal_two(monkeypatch):
    """Every program of a grid (precisions, step in backward, checkpoints) traced ahead in workers and here: each of
    its traces is the two-step trace at that batch, and all but each precision's first were traced for one step."""
    from workbench.calcgraph.forked import ENV

    build, shape = MODELS["cnn"]
    work = _work(build, shape)
    grid = [Config(p, 8 if p == "bf16" else None, step_in_backward=sib, checkpoint=ckpt)
            for p in ("fp32", "bf16") for sib in (False, True) for ckpt in ("none", "uniform")]
    monkeypatch.setenv(ENV, "2")
    plans = Plans(work, grid, uniform=[(0, 2, True), (2, 6, True)])
    plans.trace_ahead([(c, None) for c in grid])
    made = [t for traces in plans._ahead.values() for t in traces.values()]
    # each precision's plain program at 2, 3 and 4, every variant at 3: two traced for both steps
    assert sum("step2" in t.marks for t in made) == 2 and len(made) == len(grid) + 4
    for cfg in grid:
        graph = plans.graph(cfg)
        key = plans._key(cfg, None)
        for size, trace in graph._exact.items():
            _assert_same(trace, trace_program(work.program(key[0], segments=key[1]), size, work.device))


class KeepsLastReal(KeepsLast):
    """Keeps a copy of its last input in real runs only: their second step is not their first made again as the
    traces' is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not is_fake(x):
            self.last = x.detach().clone()
        return self.linear(x)


def _calibrations(work: Workload, cfg: Config, monkeypatch) -> tuple[list, list]:
    """(the steps of each real run, the plan's calibrated sizes and scratch at 3, 12 and 64) calibrated as the advisor
    does it, and the same with every real run of both steps."""
    out = []
    for one_step in (work.program(cfg, steps=1), None):
        graph = CompiledGraph(work.program(cfg), device="cpu", trace_sizes=(2, 3), one_step=one_step)
        steps = []

        def counted(program, size, device, steps=steps, one_step=one_step):
            steps.append(1 if program is one_step else 2)
            return observe(program, size, device)
        monkeypatch.setattr(derive, "observe", counted)
        graph.calibrate(sizes=(2, 4, 8), check=(), refine=0)
        out.append((steps, [(graph.calibration.allocations(b), graph.calibration.scratch(b), graph.required_bytes(b))
                            for b in (3, 12, 64)], graph.calibration.line_held))
    return out


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("cfg", CONFIGS[:3], ids=lambda c: c.name)
def test_calibration_runs_one_step_where_the_real_second_step_is_the_first_made_again(model, cfg, monkeypatch):
    (steps, made, held), (both_steps, runs, held_both) = _calibrations(_work(*MODELS[model]), cfg, monkeypatch)
    assert steps == [2, 1, 1] and both_steps == [2, 2, 2] and held == held_both
    for (sizes, scratch, peak), (sizes_both, scratch_both, peak_both) in zip(made, runs, strict=True):
        np.testing.assert_array_equal(sizes, sizes_both)
        np.testing.assert_array_equal(scratch, scratch_both)
        assert peak == peak_both


def test_calibration_runs_both_steps_where_the_real_runs_differ_from_the_traces(monkeypatch):
    (steps, made, _), (_, runs, _) = _calibrations(_work(KeepsLastReal, (6,)), Config(), monkeypatch)
    assert steps == [2, 2, 2]
    assert [peak for *_, peak in made] == [peak for *_, peak in runs]
