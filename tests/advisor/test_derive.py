"""One trace per variant (issue 45): a program with step in backward or activation checkpoints, traced once at the
batch its plain program was fitted at, each allocation's growth borrowed from that plain program
(`calcgraph.derive`). Its plan must answer every batch as the variant's own traces at that batch do, and equal the
variant fitted from two traces of its own; what it cannot place falls back to the second trace."""

import numpy as np
import pytest
import torch
from torch import nn

from workbench.advisor import Config, advise
from workbench.calcgraph import CompiledGraph
from workbench.calcgraph.tracker import _trace

pytestmark = pytest.mark.usefixtures("one_thread")

VARIANTS = [Config(step_in_backward=True), Config(checkpoint="uniform"),
            Config(step_in_backward=True, checkpoint="uniform")]


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(x))) + x


class LSTMBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lstm, self.out = nn.LSTM(dim, dim, batch_first=True), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.lstm(x)[0])


class Pool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=tuple(range(1, x.dim() - 1))) if x.dim() > 2 else x


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *(ConvBlock(8) for _ in range(3)), nn.Flatten(1),
                         nn.Linear(8 * 8 * 8, 5))


def attention() -> nn.Module:
    return nn.Sequential(*(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True) for _ in range(3)),
                         Pool(), nn.Linear(16, 5))


def lstm() -> nn.Module:
    return nn.Sequential(*(LSTMBlock(12) for _ in range(3)), Pool(), nn.Linear(12, 5))


MODELS = {"cnn": (cnn, (3, 8, 8)), "attention": (attention, (6, 16)), "lstm": (lstm, (5, 12))}


def _peak(trace) -> int:
    ev = trace.events
    return int(np.cumsum(np.where(ev >= 0, trace.sizes[np.maximum(ev, 0)], -trace.sizes[np.maximum(-ev - 1, 0)]))
               .max(initial=0))


@pytest.fixture(scope="module", params=list(MODELS))
def advised(request):
    build, shape = MODELS[request.param]
    torch.manual_seed(0)
    x, y = torch.randn(4, *shape), torch.randint(0, 5, (4,))
    advice = advise(build, (x, y), memory_budget=2**40, calibrate=False, min_run_time=0.01, progress=False,
                    candidates=[Config(), *VARIANTS])
    return request.param, advice


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda c: c.name)
def test_a_variant_traced_once_answers_each_batch_as_its_own_trace_there(advised, variant):
    name, advice = advised
    graph = advice._plans.graph(variant)
    assert graph.derived and graph._base_size in graph._exact, (name, variant.name)
    for size in (1, 3, 17, 64, 100):
        own = _trace(lambda tracker, size=size: graph._program(size, tracker), device=torch.device("cpu"))
        assert graph.required_bytes(size) == _peak(own), (name, variant.name, size)
        # NOTE: peaks, not every allocation: one of oneDNN's LSTM backward outputs is 192 bytes at batches 2 to 4
        # and 816 at 17 (2,304 from 64), off the line of a fit from two traces as much as of this one
        if name != "lstm" and size > 1:  # batch 1 may run a program of its own (`_batch_one`)
            np.testing.assert_array_equal(graph._planned_sizes(size), own.sizes, err_msg=f"{name} {size}")


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda c: c.name)
def test_a_variant_traced_once_equals_its_fit_from_two_traces(advised, variant):
    name, advice = advised
    graph = advice._plans.graph(variant)
    two = CompiledGraph(graph._program, device="cpu", trace_sizes=(2, 3))
    assert two.affine and not two.derived
    np.testing.assert_array_equal(graph.slope, two.slope, err_msg=name)
    np.testing.assert_array_equal(graph.intercept, two.intercept, err_msg=name)


def test_every_variant_of_the_suite_is_traced_once(advised):
    name, advice = advised
    plans = advice._plans
    assert plans.programs == 4, name
    # the plain program at 2, 3 and 4 (batch 1 where asked: `_batch_one`), each variant at 3 (and 1 where asked)
    assert sum(len(plans.graph(v)._exact) - (1 in plans.graph(v)._exact) for v in VARIANTS) == 3, name


def _fake_program(extra: bool, ambiguous: bool):
    """A program of two allocations of one place (`torch.zeros([9])` twice at batch 3); `ambiguous`: the second
    grows with the batch (`zeros([3 * batch])`); `extra`: a variant adds an allocation the plain program lacks."""
    def program(size: int, tracker) -> None:
        a = torch.zeros(9)
        b = torch.zeros(3 * size if ambiguous else 9)
        c = torch.ones(7 * size) if extra else None
        del a, b, c
    return program


@pytest.mark.parametrize("ambiguous, extra", [(True, False), (False, True)], ids=["ambiguous place", "new place"])
def test_a_variant_with_an_allocation_it_cannot_place_is_traced_twice(ambiguous, extra):
    plain = CompiledGraph(_fake_program(False, ambiguous), device="cpu")
    variant = CompiledGraph(_fake_program(extra, ambiguous), device="cpu", trace_sizes=(2, 3), like=plain)
    own = CompiledGraph(_fake_program(extra, ambiguous), device="cpu", trace_sizes=(2, 3))
    assert not variant.derived and sorted(variant._exact) == [2, 3]
    np.testing.assert_array_equal(variant.slope, own.slope)
    assert [variant.required_bytes(b) for b in (1, 5, 40)] == [own.required_bytes(b) for b in (1, 5, 40)]


def test_a_variant_with_only_placed_allocations_is_traced_once():
    plain = CompiledGraph(_fake_program(False, False), device="cpu")
    variant = CompiledGraph(_fake_program(False, False), device="cpu", trace_sizes=(2, 3), like=plain)
    assert variant.derived and sorted(variant._exact) == [3]
    assert variant.required_bytes(40) == plain.required_bytes(40)
