"""Traces side by side in forked workers (issue 45, `calcgraph.forked`): each result is the one the calling process
would have made, a job a worker could not finish comes back None for the caller to run, and a plan or an advisor
table made with workers equals the one made in one process."""

import time

import numpy as np
import pytest
import torch
from torch import nn

from workbench.advisor import Config, advise
from workbench.advisor import plans as plans_module
from workbench.advisor.plan import _recomputed
from workbench.calcgraph import CompiledGraph, forked
from workbench.calcgraph.forked import ENV, run_forked, trace_program, worker_count

pytestmark = pytest.mark.usefixtures("one_thread")


def test_closures_that_do_not_pickle_run_in_workers_and_come_back_in_order():
    model = nn.Linear(3, 2)  # captured, never pickled
    jobs = [lambda i=i: (i, model.weight.shape, torch.ones(i).sum().item()) for i in range(5)]
    assert run_forked(jobs, processes=2) == [(i, (2, 3), float(i)) for i in range(5)]


def test_workers_leave_collection_to_the_traces_and_the_callers_heap_out_of_it():
    import gc

    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    state = lambda: (gc.isenabled(), gc.get_freeze_count() > 0)  # noqa: E731
    assert run_forked([state, state], processes=2) == [(False, True), (False, True)]
    assert (gc.isenabled(), gc.get_freeze_count()) == (enabled, frozen)  # the caller's collector as it was


def test_a_failing_job_is_left_to_the_caller_and_the_others_come_back():
    def boom():
        raise RuntimeError("no")

    assert run_forked([lambda: 1, boom, lambda: 3], processes=2) == [1, None, 3]


def test_one_process_leaves_every_job_to_the_caller(monkeypatch):
    assert run_forked([lambda: 1, lambda: 2], processes=1) == [None, None]
    monkeypatch.setenv(ENV, "1")
    assert worker_count() == 1 and run_forked([lambda: 1, lambda: 2]) == [None, None]


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5", "٢"])
def test_a_bad_process_count_is_named(monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=ENV):
        worker_count()


def test_workers_that_stop_progressing_are_stopped_and_their_jobs_left_to_the_caller(monkeypatch):
    monkeypatch.setattr(forked, "STALL_SECONDS", 1.0)
    monkeypatch.setattr(forked, "_POLL_SECONDS", 0.2)
    start = time.perf_counter()
    results = run_forked([lambda: time.sleep(60), lambda: time.sleep(60)], processes=2)
    assert results == [None, None] and time.perf_counter() - start < 20


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.ReLU(), nn.Flatten(1), nn.Linear(8 * 6 * 6, 4))


def _program(size: int, tracker) -> None:
    model = _net()
    opt = torch.optim.Adam(model.parameters())
    for _ in range(2):
        model(torch.randn(size, 3, 6, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _same_trace(a, b) -> None:
    np.testing.assert_array_equal(a.sizes, b.sizes)
    np.testing.assert_array_equal(a.events, b.events)
    assert a.signature == b.signature and a.info == b.info and a.keys == b.keys and a.spec == b.spec


def test_a_plans_traces_made_by_workers_equal_its_own(monkeypatch):
    made = []

    def spy(jobs, processes=None):
        made.append(results := run_forked(jobs, processes))
        return results

    monkeypatch.setattr(forked, "FORK_AFTER_SECONDS", 0.0)  # every fit's later traces go to workers
    monkeypatch.setattr(forked, "run_forked", spy)
    graph = CompiledGraph(_program, device="cpu", trace_sizes=(2, 3, 4))
    assert len(made) == 1 and all(t is not None for t in made[0])  # batches 3 and 4 came from workers
    monkeypatch.setenv(ENV, "1")
    alone = CompiledGraph(_program, device="cpu", trace_sizes=(2, 3, 4))
    for size in (2, 3, 4):
        _same_trace(graph._exact[size], alone._exact[size])
    assert graph.affine and [graph.required_bytes(b) for b in (1, 7, 50)] == [alone.required_bytes(b)
                                                                              for b in (1, 7, 50)]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(x))) + x


def _blocks() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *(Block() for _ in range(4)), nn.Flatten(1),
                         nn.Linear(8 * 6 * 6, 4))


def test_the_advisors_table_is_the_same_with_workers_and_without(monkeypatch):
    torch.manual_seed(0)
    batch = (torch.randn(4, 3, 6, 6), torch.randint(0, 4, (4,)))
    grid = [Config(), Config(step_in_backward=True), Config(checkpoint="uniform"), Config(checkpoint="optimal"),
            Config("bf16", 8)]

    made = []

    def spy(jobs, processes=None):
        made.extend(results := run_forked(jobs, processes))
        return results

    monkeypatch.setattr(plans_module, "run_forked", spy)

    def table(processes: str):
        monkeypatch.setenv(ENV, processes)
        advice = advise(_blocks, batch, memory_budget=2**40, calibrate=False, min_run_time=0.01, progress=False,
                        candidates=grid)
        budget = float(advice.table["predicted_peak_bytes"].median())
        advice.rebudget(budget)  # the optimal candidate planned again: its program traced ahead
        plans = advice._plans
        return (advice.table.drop(columns=["predicted_step_seconds", "time_reliable"]),
                {k[0].name: (sorted(g._exact), sorted(_recomputed(g)), g.derived)
                 for k, g in plans._graphs.items()})

    (alone, graphs_alone) = table("1")
    assert made and not any(made)
    made.clear()
    (forked_table, graphs) = table("2")
    assert len(made) >= 6 and all(t is not None for t in made)  # 3 + 3 traces of the programs (2 plain), 1 optimal
    assert graphs == graphs_alone and any(recomputed for _, recomputed, _ in graphs.values())
    assert all(derived for name, (_, _, derived) in graphs.items() if "checkpoint" in name or "backward" in name)
    assert forked_table.equals(alone)


def test_a_trace_does_not_depend_on_what_the_process_traced_before():
    """An LSTM's backward freed its initial state on either side of `mkldnn_rnn_layer_backward` depending on
    FakeTensor's dispatch cache: a second trace at one batch differed from the first."""
    def program(size: int, tracker) -> None:
        model = nn.LSTM(6, 6, batch_first=True)
        model(torch.randn(size, 5, 6))[0].sum().backward()

    first, second = (trace_program(program, 3, torch.device("cpu")) for _ in range(2))
    _same_trace(first, second)


def test_what_workers_cached_comes_back_and_serves_this_process(monkeypatch):
    """A worker sends back the dispatch cache entries its traces made (`kernels.new_entries`), and this process adds
    them to its own before its next trace: that trace then finds every op call there and equals the worker's."""
    from workbench.calcgraph import kernels

    monkeypatch.setattr(kernels, "_CACHE", {})
    monkeypatch.setattr(kernels, "_RECEIVED", [])
    jobs = [lambda size=size: trace_program(_program, size, torch.device("cpu")) for size in (2, 3)]
    traced = run_forked(jobs, processes=2)
    assert all(t is not None for t in traced) and len(kernels._RECEIVED) == 2 and not kernels._CACHE
    kernels.merge_received()
    merged = len(kernels._CACHE)
    assert merged > 0 and not kernels._RECEIVED
    for size, there in zip((2, 3), traced, strict=True):
        _same_trace(trace_program(_program, size, torch.device("cpu")), there)
    assert len(kernels._CACHE) == merged  # every call found in what the workers sent


def test_an_entry_that_does_not_pickle_is_left_out_and_a_batch_that_does_not_load_is_dropped(monkeypatch):
    from workbench.calcgraph import kernels

    monkeypatch.setattr(kernels, "_CACHE", {})
    monkeypatch.setattr(kernels, "_RECEIVED", [])
    trace_program(_program, 2, torch.device("cpu"))
    made = dict(kernels._CACHE)
    kernels._CACHE["unpicklable"] = lambda: None
    kernels.mark_sent()
    assert kernels.new_entries() == b""  # nothing new since
    monkeypatch.setattr(kernels, "_SENT", 0)
    sent = kernels.new_entries()
    monkeypatch.setattr(kernels, "_CACHE", {})
    kernels.receive(b"not a pickle")
    kernels.receive(sent)
    kernels.merge_received()
    assert kernels._CACHE.keys() == made.keys() and not kernels._RECEIVED
    # past CACHE_ENTRIES the older entries go first
    monkeypatch.setattr(kernels, "CACHE_ENTRIES", len(made) + 1)
    monkeypatch.setattr(kernels, "_CACHE", {"older": None, "entries": None})
    kernels.receive(sent)
    kernels.merge_received()
    assert kernels._CACHE.keys() == made.keys()


def test_batch_one_is_traced_side_by_side_for_every_program_the_search_asks_it_of(monkeypatch):
    """A budget above the weights, gradients and state every program holds but below two programs' peaks at batch 2:
    the largest-batch search asks both for batch 1, a program of its own (`CompiledGraph._batch_one`), traced side by
    side in workers before the search; the table is the one made with each traced where the search asks."""
    torch.manual_seed(0)
    batch = (torch.randn(4, 3, 6, 6), torch.randint(0, 4, (4,)))
    grid = [Config(), Config("amp_bf16"), Config("bf16", 8)]
    monkeypatch.setenv(ENV, "2")

    def advice_at(budget_of=None):
        advice = advise(_blocks, batch, memory_budget=2**40, calibrate=False, min_run_time=0.01, progress=False,
                        candidates=grid)
        plans = [advice._by_name[c.name] for c in grid]
        held = max(plan.held_bytes(4) for plan in plans)
        cap = min(plan.peak(2) for plan in plans if plan.peak(2) > held) - 1
        return advice, cap / (1 - advice.margin)

    made = []

    def spy(jobs, processes=None):
        made.append(results := run_forked(jobs, processes))
        return results

    advice, budget = advice_at()
    monkeypatch.setattr(plans_module, "run_forked", spy)
    advice.rebudget(budget)
    assert len(made) == 1 and len(made[0]) == 2 and all(t is not None for t in made[0])
    assert [1 in advice._plans.graph(c)._exact for c in grid] == [True, True, False]
    with monkeypatch.context() as patch:
        patch.setattr(plans_module.Plans, "trace_batch_one", lambda self, plans: None)
        alone, _ = advice_at()
        alone.rebudget(budget)
    assert advice.table["max_batch"].tolist()[:2] == [1, 1]
    assert advice.table["max_batch"].tolist() == alone.table["max_batch"].tolist()
