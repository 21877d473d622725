"""workbench.vbs.dynamic_program: the DP of Choudhury et al. (Section III) and `plan`, the best of
the DP and both baselines."""

import math

import numpy as np
import pytest

from workbench import vbs


def test_worked_example(worked_example):
    p = vbs.dp(worked_example, memory=7, batch=2)
    assert p.method == "vbs" and p.layer_batches == {"L1": [2], "L2": [1, 1], "L3": [2]}
    assert p.time_per_sample == pytest.approx(10.0)
    assert p.peak <= 7
    assert vbs.fbs(worked_example, memory=7, batch=2).time_per_sample == pytest.approx(12.0)
    # with 12 units, batch 2 fits everywhere: 3 per sample per layer
    assert vbs.dp(worked_example, memory=12, batch=2).time_per_sample == pytest.approx(9.0)
    best = vbs.plan(worked_example, memory=7, batch=2)  # DP and Greedy-VBS tie: the DP is kept
    assert best.method == "vbs" and best.time_per_sample == pytest.approx(10.0)


def test_infeasible_budgets_name_the_smallest_feasible_one(worked_example):
    with pytest.raises(ValueError, match="smallest feasible budget is 7 units"):
        vbs.dp(worked_example, memory=6, batch=2)
    with pytest.raises(ValueError, match="smallest feasible budget is 7 units"):
        vbs.plan(worked_example, memory=6, batch=2)
    planner = vbs.Planner(worked_example, memory=12)
    assert planner.smallest_feasible(2) == 7
    curve = planner.curve(2)
    assert np.all(np.isinf(curve[:7])) and curve[7] == pytest.approx(10.0)
    assert np.all(np.diff(curve[7:]) <= 1e-12)  # more memory never hurts
    assert planner.plan(memory=7, batch=2).steps == vbs.dp(worked_example, memory=7, batch=2).steps


def test_bad_input(worked_example):
    with pytest.raises(ValueError, match="batch must be an int in 1..2"):
        vbs.dp(worked_example, memory=7, batch=3)
    with pytest.raises(ValueError, match="batch must be an int in 1..2"):
        vbs.plan(worked_example, memory=7, batch=3)
    with pytest.raises(ValueError, match="memory must be an int >= 0"):
        vbs.plan(worked_example, memory=-1, batch=1)
    with pytest.raises(ValueError, match="exceeds"):
        vbs.Planner(worked_example, memory=10**9)
    assert vbs.plan(worked_example, memory=10**9, batch=2).time_per_sample == pytest.approx(9.0)  # picks a unit
    with pytest.raises(ValueError, match="for this Planner"):
        vbs.Planner(worked_example, memory=7).plan(memory=8, batch=1)
    with pytest.raises(TypeError):
        vbs.plan("tables", memory=7, batch=1)


def _opt_trees(i, j, b):
    if i > j or b == 0:
        yield ()
        return
    for b1 in range(1, b + 1):
        for first in _exact_trees(i, j, b1):
            for rest in _opt_trees(i, j, b - b1):
                yield first + rest


def _exact_trees(i, j, b):
    for k in range(i, j + 1):
        for left in _opt_trees(i, k - 1, b):
            for right in _opt_trees(k + 1, j, b):
                yield left + ((k, b),) + right


def exhaustive(tables: vbs.LayerProfile, a: np.ndarray, memory: int, batch: int) -> float:
    """Best time per sample over every nested phase schedule, memory checked by simulation."""
    n, best = tables.n_layers, math.inf
    for schedule in set(_opt_trees(0, n - 1, batch)):
        pending = [batch] + [0] * n
        peak = seconds = 0
        for k, q in schedule:
            peak = max(peak, sum(int(x) * c for x, c in zip(a, pending, strict=True))
                       + tables.ws[k, q - 1] + a[k + 1] * q)
            seconds += q * tables.time[k, q - 1]
            pending[k] -= q
            pending[k + 1] += q
        if peak <= memory:
            best = min(best, seconds / batch)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_dp_equals_exhaustive_search_over_nested_schedules(seed, random_linear):
    """The DP's tables hold the optimum of the paper's accounting exactly; the plan it returns is
    executable within the budget (copies included), so never faster than that optimum."""
    rng = np.random.default_rng(seed)
    n, B = int(rng.integers(2, 4)), int(rng.integers(2, 5))
    tables, a = random_linear(rng, n, B)
    low = vbs.fbs_peak(tables, batch=B, size=1)
    for memory in (low - 1, low, low + 3, low + 8, low + 20):
        want = exhaustive(tables, a, memory, B)
        assert vbs.Planner(tables, memory=max(memory, 0)).curve(B)[max(memory, 0)] == pytest.approx(want, rel=1e-9)
        try:
            got = vbs.dp(tables, memory=memory, batch=B)
        except ValueError:
            assert memory < vbs.smallest_budget(tables, batch=B, method="dp")
            continue
        assert got.time_per_sample >= want * (1 - 1e-9)
        assert got.peak <= memory


def _feasible(method, tables, memory, batch):
    try:
        return method(tables, memory=memory, batch=batch)
    except ValueError:
        return None


@pytest.mark.parametrize("seed", range(16))
def test_plan_is_never_slower_than_the_dp_fbs_or_greedy(seed, random_linear, random_branched):
    """On small random tables: plan() is the fastest feasible of the three and respects memory;
    the DP alone is never slower than FBS (FBS is one of its nested schedules)."""
    rng = np.random.default_rng(100 + seed)
    B = int(rng.integers(3, 7))
    tables = random_branched(rng, B) if seed % 2 else random_linear(rng, int(rng.integers(3, 8)), B)[0]
    low = vbs.fbs_peak(tables, batch=B, size=1)
    for memory in range(low, low + 40, 5):
        dp, base = vbs.dp(tables, memory=memory, batch=B), vbs.fbs(tables, memory=memory, batch=B)
        greedy = _feasible(vbs.greedy_vbs, tables, memory, B)
        best = vbs.plan(tables, memory=memory, batch=B)
        assert dp.time_per_sample <= base.time_per_sample * (1 + 1e-12)
        assert best.time_per_sample <= min(dp.time_per_sample, base.time_per_sample) * (1 + 1e-12)
        if greedy is not None:
            assert best.time_per_sample <= greedy.time_per_sample * (1 + 1e-12)
        assert best.peak <= memory and dp.peak <= memory and base.peak <= memory
        assert best.method in ("vbs", "fbs", "greedy")
        assert all(sum(bs) == B for bs in best.layer_batches.values())


def test_plan_returns_greedy_where_it_beats_the_dp(random_linear):
    """The DP is optimal among nested schedules only: where Greedy-VBS is faster, plan() says so."""
    found = 0
    for seed in range(1010, 1040):  # 1017, 1025 and 1036 have such budgets
        rng = np.random.default_rng(seed)
        B = int(rng.integers(3, 7))
        tables = random_linear(rng, int(rng.integers(3, 8)), B)[0]
        low = vbs.fbs_peak(tables, batch=B, size=1)
        for memory in range(low, low + 40, 5):
            greedy = _feasible(vbs.greedy_vbs, tables, memory, B)
            dp = vbs.dp(tables, memory=memory, batch=B)
            if greedy is not None and greedy.time_per_sample < dp.time_per_sample * (1 - 1e-9):
                best = vbs.plan(tables, memory=memory, batch=B)
                assert best.method == "greedy" and best.time_per_sample == greedy.time_per_sample
                found += 1
    assert found >= 3


def test_branched_steps_hold_the_group_input_and_output(random_branched):
    tables = random_branched(np.random.default_rng(7), 4)
    p = vbs.dp(tables, memory=vbs.fbs_peak(tables, batch=4, size=2), batch=4)
    for step in (s for s in p.steps if s.layer == 2):
        group = int(tables.inp[2, step.batch - 1] + tables.out[2, step.batch - 1])
        assert step.used == group and len(step.branches) == 3
        assert sum(s.batch for s in step.branches[0] if s.layer == 1) == step.batch
        assert all(s.reserved >= step.reserved + group for br in step.branches for s in br)
        assert step.branches[2] == ()


# --- plan() picks its unit; its infeasibility message names the true smallest budget -----------


def _in_bytes(tables: vbs.LayerProfile, rng, scale: int = 1_000_003) -> vbs.LayerProfile:
    """The same tables in bytes: every memory entry x `scale` plus up to 999 bytes of jitter."""

    def mem(a: np.ndarray) -> np.ndarray:
        return np.where(a > 0, a * scale + rng.integers(0, 1000, a.shape), 0)

    out = vbs.LayerProfile(tables.time, mem(tables.inp), mem(tables.out), mem(tables.ws), tables.names)
    out.branches = {i: [_in_bytes(p, rng, scale) for p in ps] for i, ps in tables.branches.items()}
    out.merge = dict(tables.merge)
    out.__post_init__()
    return out


def test_plan_picks_its_unit_for_a_profile_in_bytes(random_branched):
    rng = np.random.default_rng(5)
    tables = _in_bytes(random_branched(rng, 4), rng)
    memory = 3 * vbs.smallest_budget(tables, batch=4)  # tens of MB, in bytes
    with pytest.raises(ValueError, match="exceeds"):  # the exact DP cannot take a table this size
        vbs.dp(tables, memory=memory, batch=4)
    p = vbs.plan(tables, memory=memory, batch=4)
    assert p.peak_bytes <= memory and p.unit_bytes == -(-memory // vbs.DEFAULT_RESOLUTION)
    assert p.memory <= vbs.DEFAULT_RESOLUTION and p.time_per_sample <= vbs.fbs(tables, memory=memory,
                                                                               batch=4).time_per_sample
    coarse = vbs.plan(tables, memory=memory, batch=4, resolution=16)
    assert coarse.memory <= 16 and coarse.peak_bytes <= memory
    assert vbs.plan(tables, memory=memory, batch=4, resolution=4096).time_per_sample <= coarse.time_per_sample
    with pytest.raises(ValueError, match="resolution must be an int >= 1"):
        vbs.plan(tables, memory=memory, batch=4, resolution=0)


def test_plan_serves_every_budget_from_the_smallest_one_in_bytes(random_linear, random_branched):
    for seed in range(4):
        rng = np.random.default_rng(200 + seed)
        small = random_branched(rng, 3) if seed % 2 else random_linear(rng, 4, 3)[0]
        tables = _in_bytes(small, rng)
        floor = vbs.smallest_budget(tables, batch=3)
        with pytest.raises(ValueError, match=f"smallest feasible budget is {floor} units"):
            vbs.plan(tables, memory=floor - 1, batch=3)
        # just above the floor the DP's rounded tables leave no room: the schedule of least memory fits
        for memory in (floor, floor + 1, floor + 5000, floor + floor // 100):
            p = vbs.plan(tables, memory=memory, batch=3)
            assert p.peak_bytes <= memory and all(sum(bs) == 3 for bs in p.layer_batches.values())


def test_the_infeasibility_message_names_the_true_smallest_budget(random_linear, random_branched):
    """The smallest budget `plan` accepts is the one the message names, and every budget from it up
    is served; the DP's own floor was named before, although Greedy-VBS fits in less."""
    below_dp = 0
    for seed in (41, 44, 51, 55, 64, 73):
        rng = np.random.default_rng(seed)
        B = int(rng.integers(2, 7))
        tables = random_branched(rng, B) if seed % 2 else random_linear(rng, int(rng.integers(2, 8)), B)[0]
        for batch in range(2, B + 1):
            upper = vbs.fbs_peak(tables, batch=batch, size=1)
            true = vbs.smallest_budget(tables, batch=batch)
            budgets = range(true, min(true + 12, upper + 1))
            assert all(_feasible(vbs.plan, tables, m, batch) is not None for m in budgets)
            with pytest.raises(ValueError, match=f"the smallest feasible budget is {true} units"):
                vbs.plan(tables, memory=true - 1, batch=batch)
            dp_floor = vbs.Planner(tables, memory=upper).smallest_feasible(batch)
            assert dp_floor == vbs.smallest_budget(tables, batch=batch, method="dp")
            with pytest.raises(ValueError, match=f"the smallest feasible budget is {dp_floor} units"):
                vbs.dp(tables, memory=dp_floor - 1, batch=batch)
            below_dp += true < dp_floor
    assert below_dp >= 1  # cases where the DP's floor (the old message) was not the smallest budget
