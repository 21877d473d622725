"""Checkpoint placements made, not traced (issue 45): a placement over a model's blocks runs the plain program's calls
plus, for each chosen block, what the every-block program adds for it, so the advisor composes its trace from those two
traces (`calcgraph.placements.compose`). The trace it makes must be the placement's own, field by field; where it
cannot decide when a tensor dies, it refuses and the placement is traced."""

import functools
import itertools
import random

import numpy as np
import pytest
import torch
from torch import nn

import workbench.advisor.plans as plans_module
from workbench.advisor import Config
from workbench.advisor.configs import block_labels
from workbench.advisor.plans import Plans
from workbench.advisor.workload import Workload
from workbench.calcgraph.forked import trace_program
from workbench.calcgraph.placements import compose
from workbench.models import densenet_bc

from tests.advisor.test_derive import LSTMBlock, Pool
from tests.advisor.test_one_step import _assert_same

pytestmark = pytest.mark.usefixtures("one_thread")

PRECISIONS = [Config(), Config("amp_bf16"), Config("bf16", 8)]


class Encoder(nn.Module):
    """torch's transformer layers (attention, dropout) in a model that is no layer sequence: checkpointed by block."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.head = nn.Linear(12, 16), nn.Linear(16, 5)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
                                    for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(1))


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks, self.pool, self.head = nn.ModuleList(LSTMBlock(12) for _ in range(3)), Pool(), nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.pool(x))


class Store(list):
    """What transformers' key-value cache is to a checkpoint: an object that holds tensors, not a container it copies
    (torch's pytree: a list, but not a subclass; `advisor.blocks`)."""


class Keeping(nn.Module):
    """A block that keeps what it computes in a list every block is given."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(12, 12)

    def forward(self, x: torch.Tensor, kept: list) -> torch.Tensor:
        kept.append(torch.tanh(self.linear(x)))
        return kept[-1] * x


class Cached(nn.Module):
    def __init__(self, store: type = list) -> None:
        super().__init__()
        self.store = store
        self.blocks, self.head = nn.ModuleList(Keeping() for _ in range(3)), nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = self.store()
        for block in self.blocks:
            x = block(x, kept)
        return self.head(x)


class Holding(nn.Module):
    """A transformer layer that keeps its input in a list every layer is given."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)

    def forward(self, x: torch.Tensor, kept: list) -> torch.Tensor:
        kept.append(x)
        return self.layer(x)


class HoldingEncoder(Encoder):
    """The encoder whose layers keep their inputs in a `Store`, which each checkpoint holds whole: refused."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Holding() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, kept = self.stem(x), Store()
        for layer in self.layers:
            x = layer(x, kept)
        return self.head(x.mean(1))


def dense() -> nn.Module:
    """The project's DenseNet-BC at depth 22: three dense blocks of three layers, each layer's checkpoint holding every
    feature map before it (the case the every-block trace alone cannot show)."""
    return densenet_bc(22, growth_rate=4, num_classes=5)


MODELS = {"encoder": (Encoder, (6, 12)), "recurrent": (Recurrent, (5, 12)), "densenet": (dense, (3, 8, 8))}


def _work(build, shape) -> Workload:
    return Workload.of(build, torch.randn(4, *shape), torch.randint(0, 5, (4,)), None, "adamw", 1e-3,
                       torch.device("cpu"))


def _placements(n: int) -> list[set[int]]:
    """Every placement of a few blocks, or eight drawn ones, besides none and all."""
    if n <= 4:
        return [set(c) for k in range(1, n) for c in itertools.combinations(range(n), k)]
    rng = random.Random(0)
    return [set(rng.sample(range(n), rng.randint(1, n - 1))) for _ in range(8)]


def _same(made, traced) -> None:
    assert made is not None and made.composed
    _assert_same(made, traced)
    assert made.points == traced.points


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("cfg", PRECISIONS, ids=lambda c: c.name)
def test_a_composed_placement_is_its_traced_program(model, cfg):
    build, shape = MODELS[model]
    work, blocks = _work(build, shape), block_labels(build)
    assert len(blocks) >= 3
    plain, every = (trace_program(work.program(Config(cfg.precision, cfg.extra_bits, checkpoint=kind), steps=1), 3,
                                  work.device) for kind in ("none", "uniform"))
    _same(compose(plain, every, blocks, set()), plain)
    _same(compose(plain, every, blocks, set(range(len(blocks)))), every)
    optimal = Config(cfg.precision, cfg.extra_bits, checkpoint="optimal")
    for chosen in _placements(len(blocks)):
        segments = [(i, i + 1, i in chosen) for i in range(len(blocks))]
        traced = trace_program(work.program(optimal, steps=1, segments=segments), 3, work.device)
        _same(compose(plain, every, blocks, chosen), traced)
        assert traced.recomputing and not traced.composed


@pytest.mark.parametrize("store", [list, Store], ids=["list", "object"])
def test_what_a_checkpoint_holds_through_its_arguments(store):
    """A list given to every block is copied by each checkpoint, which then holds what it held then and runs calls on
    it: every placement is composed. An object that holds tensors is held whole by each checkpoint given it: a tensor
    that no later block used lives until the last such checkpoint lets go, which neither trace can place, so the
    placements are refused, not guessed."""
    build = functools.partial(Cached, store)
    work, blocks = _work(build, (12,)), block_labels(build)
    plain, every = (trace_program(work.program(Config(checkpoint=kind), steps=1), 3, work.device)
                    for kind in ("none", "uniform"))
    composed = 0
    for chosen in _placements(len(blocks)):
        made = compose(plain, every, blocks, chosen)
        if made is not None:
            composed += 1
            segments = [(i, i + 1, i in chosen) for i in range(len(blocks))]
            _same(made, trace_program(work.program(Config(checkpoint="optimal"), steps=1, segments=segments), 3,
                                      work.device))
    assert composed == (len(_placements(len(blocks))) if store is list else 0)


def test_what_it_cannot_read_is_refused():
    work, blocks = _work(*MODELS["encoder"]), block_labels(Encoder)
    plain, every = (trace_program(work.program(Config(checkpoint=kind), steps=1), 3, work.device)
                    for kind in ("none", "uniform"))
    both_steps = trace_program(work.program(Config()), 3, work.device)
    other = trace_program(_work(*MODELS["recurrent"]).program(Config(checkpoint="uniform"), steps=1), 3, work.device)
    assert compose(both_steps, every, blocks, {0}) is None  # two steps: not a one-step trace
    assert compose(plain, other, blocks, {0}) is None  # another model's: its calls are not found
    made = compose(plain, every, blocks, {0})
    assert compose(made, every, blocks, {0, 1}) is None  # made, not traced: it notes no uses


@pytest.fixture(scope="module")
def dense_plans():
    """DenseNet's plain, every-block and optimal programs planned with every placement traced: (work, plans)."""
    work = _work(*MODELS["densenet"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plans_module, "compose", lambda *args: None)
        plans = Plans(work, [Config()], uniform=[(i, i + 1, True) for i in range(9)])
        for cfg in (Config(), Config(checkpoint="uniform")):
            plans.graph(cfg)
        for cfg in (Config(checkpoint="optimal"), Config(step_in_backward=True, checkpoint="optimal")):
            plans.graph(cfg, SEGMENTS)
    assert plans.composed_traces == 0
    return work, plans


SEGMENTS = [(0, 2, False), (2, 3, True), (3, 5, False), (5, 7, True), (7, 9, False)]


@pytest.mark.parametrize("processes", ["2", "1"])
def test_the_advisor_composes_a_budgets_placement(monkeypatch, dense_plans, processes):
    """A budget's placement (`Advice.rebudget`) over a model's blocks is composed where its plain and every-block
    programs were made, and its program with step in backward spliced in from it, neither traced: each plan equals the
    traced one at batches 1, 3, 17 and 64."""
    from workbench.calcgraph.forked import ENV

    work, traced = dense_plans
    monkeypatch.setenv(ENV, processes)
    plans = Plans(work, [Config()], uniform=traced.uniform)
    plans.trace_ahead([(Config(checkpoint=kind), None) for kind in ("none", "uniform")])
    for kind in ("none", "uniform"):
        plans.graph(Config(checkpoint=kind))
    grid = [Config(checkpoint="optimal"), Config(step_in_backward=True, checkpoint="optimal")]
    with monkeypatch.context() as patch:
        patch.setattr(plans_module, "run_forked", lambda jobs: pytest.fail("a placement was traced"))
        plans.trace_ahead([(cfg, SEGMENTS) for cfg in grid])
        made = [plans.graph(cfg, SEGMENTS)._exact[3] for cfg in grid]
    assert [(t.composed, t.spliced) for t in made] == [(True, False), (False, True)]
    assert plans.composed_traces == 1
    for cfg in grid:
        assert [plans.plan(cfg, SEGMENTS).peak(b) for b in (1, 3, 17, 64)] == \
            [traced.plan(cfg, SEGMENTS).peak(b) for b in (1, 3, 17, 64)], cfg.name
    np.testing.assert_array_equal(plans.graph(grid[0], SEGMENTS).slope, traced.graph(grid[0], SEGMENTS).slope)


@pytest.mark.parametrize("model, fit_forked", [(Encoder, False), (Encoder, True), (HoldingEncoder, False)],
                         ids=["fit here", "fit forked", "refused"])
def test_batch_one_of_a_placement_is_composed_where_it_runs_its_own(monkeypatch, model, fit_forked):
    """A transformer's batch 1 runs kernels of its own (`CompiledGraph._batch_one`), so a placement asked for it by the
    largest-batch search (`Plans.trace_batch_one`) runs its own batch 1 too: composed from its plain and every-block
    programs' batch 1, these traced side by side, and its program with step in backward spliced from it, traced
    neither; each batch 1 is the traced program's, and nothing is traced once the search asks. Its batch 3 is
    composed too, also where the plain program's fit traced batches 3 and 4 in forked workers (a first trace slower
    than `FORK_AFTER_SECONDS`: a loaded machine), which send their one-step traces back. A placement whose composition
    was refused (a `Store` each checkpoint holds whole) is traced side by side, and its program with step in backward
    spliced from that."""
    import workbench.calcgraph.derive as derive_module
    from workbench.calcgraph import forked
    from workbench.calcgraph.forked import ENV

    monkeypatch.setenv(ENV, "2")
    monkeypatch.setattr(forked, "FORK_AFTER_SECONDS", 0.0 if fit_forked else float("inf"))
    work = _work(model, MODELS["encoder"][1])
    segments = [(0, 1, True), (1, 3, False), (3, 4, True)]
    grid = [Config(checkpoint="optimal"), Config(step_in_backward=True, checkpoint="optimal")]

    side_by_side = []

    def planned(composing: bool) -> Plans:
        with monkeypatch.context() as patch:
            if not composing:
                patch.setattr(plans_module, "compose", lambda *args: None)
                patch.setattr(plans_module, "_spliced", lambda *args: None)
            plans = Plans(work, [Config()], uniform=[(i, i + 1, True) for i in range(4)])
            for cfg in (Config(), Config(checkpoint="uniform")):
                plans.graph(cfg)
            patch.setattr(Plans, "_trace_side_by_side", lambda self, graphs, f=Plans._trace_side_by_side: f(
                self, [g for g in graphs if composing and side_by_side.append(g.description) or True]))
            plans.trace_batch_one([plans.plan(cfg, segments) for cfg in grid])
            if composing:
                patch.setattr(derive_module, "trace_program", lambda *args: pytest.fail("traced where asked"))
            for cfg in grid:
                plans.plan(cfg, segments).peak(1)
        return plans

    made, traced = planned(True), planned(False)
    graph, in_backward = (made.graph(cfg, segments) for cfg in grid)
    composed = model is Encoder
    assert graph._batch_one() is not None and graph._exact[1].composed == graph._exact[3].composed == composed
    assert in_backward._batch_one() is not None and in_backward._exact[1].spliced
    assert not any(t.composed or t.spliced for cfg in grid for t in traced.graph(cfg, segments)._exact.values())
    # the ends of a composed placement alone, else the placement itself
    assert sorted(side_by_side) == ["fp32", "fp32, checkpoint " + ("uniform" if composed else "optimal")]
    for cfg in grid:
        _assert_same(made.graph(cfg, segments)._exact[1], traced.graph(cfg, segments)._exact[1])
    for cfg in grid:
        assert made.plan(cfg, segments).peak(1) == traced.plan(cfg, segments).peak(1), cfg.name


def test_batch_one_in_one_round_where_another_program_ran_its_own(monkeypatch):
    """Once one program of a model has run its own batch 1 (a transformer's layers), another precision's placement has
    what it is composed from traced with its program's batch 1, in one round of workers, not two
    (`Plans.trace_batch_one`); its batch 1 composed as before."""
    from workbench.calcgraph.forked import ENV

    monkeypatch.setenv(ENV, "2")
    plans = Plans(_work(*MODELS["encoder"]), [Config()], uniform=[(i, i + 1, True) for i in range(4)])
    segments = [(0, 1, True), (1, 3, False), (3, 4, True)]
    for cfg in (Config(), Config(checkpoint="uniform"), Config("amp_bf16"), Config("amp_bf16", checkpoint="uniform")):
        plans.graph(cfg)
    rounds = []

    def side_by_side(self, graphs, traced=Plans._trace_side_by_side):
        graphs = list(graphs)
        rounds.append(sorted(g.description for g in graphs))
        traced(self, graphs)
    monkeypatch.setattr(Plans, "_trace_side_by_side", side_by_side)
    for precision in ("fp32", "amp_bf16"):
        plans.trace_batch_one([plans.plan(Config(precision, checkpoint="optimal"), segments)])
    amp = "amp bf16"
    assert rounds == [["fp32"], ["fp32, checkpoint uniform"], [amp, f"{amp}, checkpoint uniform"], []]
    assert plans.graph(Config("amp_bf16", checkpoint="optimal"), segments)._exact[1].composed
