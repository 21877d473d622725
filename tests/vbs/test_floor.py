"""workbench.vbs.floor: the smallest budget of each planner, found without the DP's memory axis,
and the nested schedule of least memory."""

import numpy as np
import pytest

from workbench import vbs


def _fits(method, tables, memory, batch) -> bool:
    try:
        method(tables, memory=memory, batch=batch)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("seed", range(24))
def test_the_smallest_budgets_are_exact(seed, random_linear, random_branched):
    rng = np.random.default_rng(300 + seed)
    B = int(rng.integers(2, 6))
    tables = random_branched(rng, B) if seed % 2 else random_linear(rng, int(rng.integers(2, 7)), B)[0]
    for batch in range(1, B + 1):
        upper = vbs.fbs_peak(tables, batch=batch, size=1)
        dp_floor = vbs.smallest_budget(tables, batch=batch, method="dp")
        least = vbs.Planner(tables, memory=upper).smallest_feasible(batch)
        assert least <= dp_floor <= upper and _fits(vbs.dp, tables, least, batch)
        assert not _fits(vbs.dp, tables, least - 1, batch) and _fits(vbs.dp, tables, dp_floor, batch)
        for name, method in (("fbs", vbs.fbs), ("greedy", vbs.greedy_vbs)):
            floor = vbs.smallest_budget(tables, batch=batch, method=name)
            assert _fits(method, tables, floor, batch) and not _fits(method, tables, floor - 1, batch)
        assert vbs.smallest_budget(tables, batch=batch, method="fbs") >= dp_floor  # FBS is a nested schedule
        assert vbs.smallest_budget(tables, batch=batch) == min(
            vbs.smallest_budget(tables, batch=batch, method=m) for m in ("dp", "fbs", "greedy"))


@pytest.mark.parametrize("seed", range(12))
def test_the_least_memory_plan_has_the_dp_floor_as_its_peak(seed, random_linear, random_branched):
    rng = np.random.default_rng(400 + seed)
    B = int(rng.integers(2, 6))
    tables = random_branched(rng, B) if seed % 2 else random_linear(rng, int(rng.integers(2, 7)), B)[0]
    p = vbs.least_memory_plan(tables, batch=B)
    bound = min(p.peak, vbs.smallest_budget(tables, batch=B, method="fbs"))
    floor = vbs.smallest_budget(tables, batch=B, method="dp")
    assert p.method == "vbs" and p.peak == p.memory and floor <= bound
    assert max(s.reserved + s.used for s in p.steps) <= p.peak  # the DP's accounting, the copies on top
    assert all(sum(bs) == B for bs in p.layer_batches.values())
    for step in (s for s in p.steps if s.branches):
        assert all(sum(x.batch for x in br if x.layer == 0) == step.batch for br in step.branches if br)
    # no faster than the DP at that budget, and the DP fits there too
    assert vbs.dp(tables, memory=p.peak, batch=B).time_per_sample <= p.time_per_sample * (1 + 1e-12)
    assert vbs.least_memory_plan(tables, batch=B, memory=p.peak + 3).memory == p.peak + 3


def test_the_worked_example(worked_example):
    assert vbs.smallest_budget(worked_example, batch=2, method="dp") == 7
    p = vbs.least_memory_plan(worked_example, batch=2)
    assert p.peak == 7 and p.layer_batches == {"L1": [2], "L2": [1, 1], "L3": [2]}


def test_bad_input(worked_example):
    with pytest.raises(ValueError, match="method must be one of"):
        vbs.smallest_budget(worked_example, batch=2, method="exact")
    with pytest.raises(ValueError, match="below the executed peak"):
        vbs.least_memory_plan(worked_example, batch=2, memory=6)
    with pytest.raises(ValueError, match="batch must be an int"):
        vbs.smallest_budget(worked_example, batch=3)
