"""workbench.vbs.request: a request the caller keeps is planned exactly as the tables without it in
a budget smaller by it (the shift is exact), and every plan for it holds it at every step."""

import numpy as np
import pytest

from workbench import vbs
from workbench.vbs.flow import account, check_units, table_sizes
from workbench.vbs.request import held, without_request


def test_the_worked_example_kept():
    """Section III's example (in = out = b, memory 7 for a request of 2) with the request kept: its 2
    units never leave, so the DP needs 8 (its plan of the tables without the request at 6, lifted),
    and FBS runs one sample at a time in 9."""
    t = vbs.LayerProfile(time=[[4, 3]] * 3, inp=[[1, 2]] * 3, out=[[1, 2]] * 3, ws=[[1, 2], [4, 8], [1, 2]])
    assert vbs.smallest_budget(t, batch=2, method="dp") == 7
    low = vbs.smallest_budget(t, batch=2, method="dp", request="kept")
    assert low == vbs.smallest_budget(without_request(t), batch=2, method="dp") + 2
    p = vbs.dp(t, memory=low, batch=2, request="kept")
    inner = vbs.dp(without_request(t), memory=low - 2, batch=2)
    assert p.layer_batches == inner.layer_batches and p.time_per_sample == inner.time_per_sample
    assert p.request == "kept" and p.peak <= low and all(s.reserved >= 2 - s.batch for s in p.steps)
    with pytest.raises(ValueError, match=r"infeasible for the DP with a request of 2 kept by the caller; the "
                                         rf"smallest feasible budget is {low} units"):
        vbs.dp(t, memory=low - 1, batch=2, request="kept")
    with pytest.raises(ValueError, match="below the request the caller keeps: 2 samples hold 2 units"):
        vbs.fbs(t, memory=1, batch=2, request="kept")
    with pytest.raises(ValueError, match=r"request must be one of \['pieces', 'kept'\]"):
        vbs.plan(t, memory=9, batch=2, request="copied")


@pytest.mark.parametrize("seed", range(4))
def test_every_kept_plan_holds_the_request_within_its_budget(seed, random_linear, random_branched):
    rng = np.random.default_rng(900 + seed)
    B = int(rng.integers(3, 6))
    tables = random_branched(rng, B) if seed % 2 else random_linear(rng, int(rng.integers(3, 6)), B)[0]
    request = held(tables, B)
    low = vbs.smallest_budget(tables, batch=B, request="kept")
    assert low == vbs.smallest_budget(without_request(tables), batch=B) + request
    assert low >= vbs.smallest_budget(tables, batch=B)  # the paper's frees what this holds
    with pytest.raises(ValueError):
        vbs.plan(tables, memory=low - 1, batch=B, request="kept")
    for memory in range(low, low + 24, 6):
        planner = vbs.Planner(tables, memory=memory, request="kept")
        assert planner.smallest_feasible(B) == low
        curve, inner = planner.curve(B), vbs.Planner(without_request(tables), memory=memory).curve(B)
        assert np.isinf(curve[:request]).all() and np.array_equal(curve[request:], inner[:memory + 1 - request])
        for p in (vbs.plan(tables, memory=memory, batch=B, request="kept"), planner.plan(memory=memory, batch=B),
                  vbs.least_memory_plan(tables, batch=B, request="kept")):
            executed, peak = account(p, table_sizes(tables), request="kept")
            assert p.request == "kept" and peak <= p.peak <= max(memory, p.memory)
            assert all(s.reserved + s.used >= request for s in p.steps)  # the request at every step
            assert p.check == check_units(tables)


def test_the_check_counts_one_sample_through_the_model(random_branched):
    t = vbs.LayerProfile(time=[[4, 3]] * 3, inp=[[1, 2]] * 3, out=[[1, 2]] * 3, ws=[[1, 2], [4, 8], [1, 2]])
    assert check_units(t) == 1 + 4 + 1 == vbs.fbs(t, memory=7, batch=2).check
    tables = random_branched(np.random.default_rng(5), 3)
    parts = tables.branches[2]
    branch_outs = sum(int(p.out[-1, 0]) for p in parts if p.n_layers)
    inner = max(int((p.inp[k, 0] if k else 0) + p.ws[k, 0] + p.out[k, 0]) for p in parts for k in range(p.n_layers))
    group = int(tables.inp[2, 0] + tables.out[2, 0]) + branch_outs + inner  # every branch's output held at once
    plain = max(int(tables.inp[i, 0] + tables.ws[i, 0] + tables.out[i, 0]) for i in (0, 1, 3, 4))
    assert check_units(tables) == max(group, plain)
