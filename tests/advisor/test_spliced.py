"""Step in backward made, not traced (issue 45): the program with step in backward runs the same forward and backward
as the program without it, each parameter's update where its gradient becomes ready. So the advisor traces the updates
alone (`calcgraph.program.parameter_steps`) and splices them into the trace of the program without step in backward
(`calcgraph.derive.in_backward`). The trace it makes must be the traced one, field by field; where it cannot be made,
the program is traced."""

import pytest
import torch
from torch import nn

import workbench.advisor.plans as plans_module
from workbench.advisor import Config
from workbench.advisor.plans import Plans
from workbench.advisor.workload import Workload
from workbench.calcgraph.derive import in_backward, repeat_step
from workbench.calcgraph.forked import trace_program

from tests.advisor.test_derive import MODELS
from tests.advisor.test_one_step import _assert_same as _assert_same_fields

pytestmark = pytest.mark.usefixtures("one_thread")

PRECISIONS = [Config(), Config("amp_bf16"), Config("bf16", 8)]


def _work(build, shape, optimizer: str = "adamw") -> Workload:
    return Workload.of(build, torch.randn(4, *shape), torch.randint(0, 5, (4,)), None, optimizer, 1e-3,
                       torch.device("cpu"))


def _assert_same(made, traced) -> None:
    assert made is not None
    _assert_same_fields(made, traced)


def _updates(work: Workload, cfg: Config, base):
    """`cfg`'s updates alone, in the order `base`'s gradients became ready."""
    order = [point[1] for point in base.points if point[0] == "ready"]
    return trace_program(work.parameter_steps(cfg, base.spec["parameters"], order), 3, work.device)


def _made_and_traced(work: Workload, cfg: Config, updates_of: Config | None = None):
    base = trace_program(work.program(cfg, steps=1), 3, work.device)
    updates = _updates(work, updates_of or cfg, trace_program(work.program(updates_of, steps=1), 3, work.device)
                       if updates_of is not None else base)
    sib = Config(cfg.precision, cfg.extra_bits, step_in_backward=True, checkpoint=cfg.checkpoint)
    return in_backward(base, updates), trace_program(work.program(sib, steps=1), 3, work.device), sib


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("checkpoint", ["none", "uniform"])
@pytest.mark.parametrize("cfg", PRECISIONS, ids=lambda c: c.name)
def test_step_in_backward_spliced_in_is_its_traced_program(model, checkpoint, cfg):
    work = _work(*MODELS[model])
    cfg = Config(cfg.precision, cfg.extra_bits, checkpoint=checkpoint)
    made, traced, sib = _made_and_traced(work, cfg)
    _assert_same(made, traced)
    assert made.spliced and not traced.spliced
    # and its second step, made again from it as the traces of its plain program show (`repeat_step`)
    renewed = cfg.precision == "bf16"
    _assert_same(repeat_step(made, renewed), trace_program(work.program(sib), 3, work.device))


@pytest.mark.parametrize("cfg", PRECISIONS, ids=lambda c: c.name)
def test_updates_traced_for_the_plain_program_serve_its_checkpointed_one(cfg):
    """A checkpointed model's gradients become ready in the same order as its plain program's, some inside a
    checkpoint's recomputation: the same updates, each labelled with the module its gradient became ready in."""
    work = _work(*MODELS["cnn"])
    made, traced, _ = _made_and_traced(work, Config(cfg.precision, cfg.extra_bits, checkpoint="uniform"), cfg)
    _assert_same(made, traced)


class Tied(nn.Module):
    """Tied input and output weights, a frozen layer and a layer no loss reaches (no gradient, no update)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.frozen, self.unused = nn.Linear(6, 6, bias=False), nn.Linear(6, 6), nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.frozen(self.embed(x)))
        return self.head(h @ self.embed.weight)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("cfg", PRECISIONS, ids=lambda c: c.name)
def test_tied_frozen_and_unused_parameters_and_torchs_sgd(cfg, optimizer):
    made, traced, _ = _made_and_traced(_work(Tied, (6,), optimizer), cfg)
    _assert_same(made, traced)


KEPT: list[torch.Tensor] = []


class KeepsGradient(nn.Module):
    """Keeps its weight's gradients past the program (a hook its forward registers): the update in backward frees
    none."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.hooked = nn.Linear(6, 5), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.hooked:
            self.linear.weight.register_post_accumulate_grad_hook(lambda p: KEPT.append(p.grad))
            self.hooked = True
        return self.linear(x)


def test_what_cannot_be_spliced_in_is_traced(monkeypatch):
    from workbench.calcgraph.forked import ENV

    work = _work(KeepsGradient, (6,))
    made, _, _ = _made_and_traced(work, Config())
    assert made is None  # its gradient outlives the optimizer's zero_grad
    KEPT.clear()
    cnn = _work(*MODELS["cnn"])
    base = trace_program(cnn.program(Config(), steps=1), 3, cnn.device)
    two_steps = trace_program(cnn.program(Config()), 3, cnn.device)
    other = trace_program(_work(*MODELS["lstm"]).program(Config(), steps=1), 3, cnn.device)
    assert in_backward(two_steps, _updates(cnn, Config(), base)) is None  # a two-step trace
    assert in_backward(base, _updates(_work(*MODELS["lstm"]), Config(), other)) is None  # another model's updates
    # the advisor traces it, and its plan is the traced one's
    monkeypatch.setenv(ENV, "2")
    grid = [Config(), Config(step_in_backward=True)]
    plans = Plans(work, grid)
    plans.trace_ahead([(c, None) for c in grid])
    traced = trace_program(work.program(grid[1]), 3, work.device)
    assert plans.spliced_traces == 0 and plans.graph(grid[1])._exact[3].signature == traced.signature
    KEPT.clear()


@pytest.fixture(scope="module")
def traced_plans():
    """The attention model's grid planned with every program traced, none spliced in: (work, grid, plans)."""
    work = _work(*MODELS["attention"])
    grid = [Config(p, 8 if p == "bf16" else None, step_in_backward=sib, checkpoint=ckpt)
            for p in ("fp32", "bf16") for sib in (False, True) for ckpt in ("none", "uniform")]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plans_module, "_spliced", lambda *args: None)
        plans = Plans(work, grid, uniform=[(0, 2, True), (2, 5, True)])
        for cfg in grid:
            plans.graph(cfg)
    assert plans.spliced_traces == 0
    return work, grid, plans


def _peaks(plans: Plans, cfg: Config, segments=None) -> list[int]:
    return [plans.plan(cfg, segments).peak(b) for b in (1, 3, 17, 64)]


@pytest.mark.parametrize("processes", ["2", "1"])
def test_the_advisor_splices_each_program_with_step_in_backward(monkeypatch, traced_plans, processes):
    """Every program with step in backward of a grid is made from its program without it, each precision's updates
    traced once: in the forked workers that trace the grid ahead, or in this process where there are none; each plan
    equals the program traced at every batch."""
    from workbench.calcgraph.forked import ENV

    work, grid, traced = traced_plans
    monkeypatch.setenv(ENV, processes)
    plans = Plans(work, grid, uniform=traced.uniform)
    plans.trace_ahead([(c, None) for c in grid])
    for cfg in grid:
        graph = plans.graph(cfg)
        assert all(t.spliced == cfg.step_in_backward for t in graph._exact.values()), cfg.name
    assert plans.spliced_traces == 4
    assert len(plans._updates) == 2 and all(plans._updates.values())  # per precision: made here, or sent back
    for cfg in grid:
        assert _peaks(plans, cfg) == _peaks(traced, cfg), cfg.name


def test_an_optimal_placement_with_step_in_backward_is_spliced(monkeypatch, traced_plans):
    """A budget's checkpoint placement (`Advice.rebudget`) traced for its program without step in backward, a single
    group not worth a worker: the program with step in backward is made from it here, its updates traced without
    the placement (which `training_setup` asks of an optimal plan)."""
    from workbench.calcgraph.forked import ENV

    work, _, traced = traced_plans
    monkeypatch.setenv(ENV, "2")
    segments = [(0, 2, False), (2, 3, True), (3, 5, False)]
    grid = [Config(checkpoint="optimal"), Config(step_in_backward=True, checkpoint="optimal")]
    plans = Plans(work, [Config(), *grid], uniform=traced.uniform)
    plans.trace_ahead([(c, segments) for c in grid])  # one group: traced here
    assert [plans.graph(c, segments)._exact[3].spliced for c in grid] == [False, True]
    assert plans.spliced_traces == 1
    with monkeypatch.context() as patch:
        patch.setattr(plans_module, "_spliced", lambda *args: None)
        for cfg in grid:
            assert _peaks(plans, cfg, segments) == _peaks(traced, cfg, segments), cfg.name
