"""The program CalcGraph traces is the user's (`workbench/inplace.py`): under any dispatch mode torch
sums a tensor's gradients and adds `linear`'s bias out of place; the tracer runs them in place where the plain
program does, so a real run under the tracker allocates what the plain run allocates, to a scalar (a few
tiny models peak 8 bytes higher under any dispatch mode, as they did before these paths were run in place)."""

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workbench.calcgraph import plan_training, training_program
from workbench.calcgraph.tracker import _trace
from workbench.measure import AllocatorMeter


class Residual(nn.Module):
    """A residual MLP whose output layer is tied to its input layer (two gradients reach the shared weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid = nn.Linear(24, 24), nn.Linear(24, 24)
        self.out = nn.Linear(24, 24)
        self.out.weight = self.inp.weight

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + F.relu(self.mid(h))).mean(1)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head((x + self.attn(x, x, x, need_weights=False)[0]).mean(1))


class Twice(nn.Module):
    """`h + h`: one gradient reaches `h` twice, and the engine must sum it out of place (it holds it twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(h + h) + self.b(h).relu()


CASES = {"residual tied": (Residual, (6, 24)), "attention": (Attention, (6, 16)), "twice": (Twice, (8,))}


@pytest.mark.parametrize("name", list(CASES))
def test_a_real_run_under_the_tracker_allocates_what_the_plain_run_allocates(name, one_thread):
    build, shape = CASES[name]
    gc.collect()
    with AllocatorMeter("cpu") as plain:
        training_program(build, shape, 5)
    traced = []

    def program(tracker):
        gc.collect()
        with AllocatorMeter("cpu") as meter:
            training_program(build, shape, 5, annotate=tracker)
        traced.append(meter.peak_bytes)

    _trace(program, fake=False)
    assert 0 <= traced[0] - plain.peak_bytes <= 8


@pytest.mark.parametrize("name", list(CASES))
def test_the_plan_runs_the_adds_the_plain_program_runs(name, one_thread):
    build, shape = CASES[name]
    model = build()
    with torch.profiler.profile() as prof:
        F.cross_entropy(model(torch.randn(5, *shape)), torch.zeros(5, dtype=torch.long)).backward()
    real = [e.name for e in prof.events() if e.name in ("aten::add", "aten::add_")]
    frame = plan_training(build, shape, calibrate=False).variables(5)
    planned = frame[(frame["phase"] == "step1") & frame["op"].isin(["add.Tensor"])]
    assert len(planned) == real.count("aten::add")  # every out-of-place add allocates; no other does
