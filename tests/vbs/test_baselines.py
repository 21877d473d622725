"""workbench.vbs.baselines: FBS and Greedy-VBS of Section IV, under the DP's memory accounting."""

import numpy as np
import pytest

from workbench import vbs


def test_worked_example_baselines(worked_example):
    base = vbs.fbs(worked_example, memory=7, batch=2)
    assert base.method == "fbs" and base.layer_batches == {"L1": [1, 1], "L2": [1, 1], "L3": [1, 1]}
    assert base.time_per_sample == pytest.approx(12.0)
    greedy = vbs.greedy_vbs(worked_example, memory=7, batch=2)
    assert greedy.method == "greedy" and greedy.time_per_sample == pytest.approx(10.0)
    assert greedy.layer_batches == {"L1": [2], "L2": [1, 1], "L3": [2]} and greedy.peak <= 7


def test_infeasible_budgets_are_named(worked_example):
    with pytest.raises(ValueError, match="FBS is infeasible"):
        vbs.fbs(worked_example, memory=6, batch=2)
    with pytest.raises(ValueError, match="Greedy-VBS is infeasible"):
        vbs.greedy_vbs(worked_example, memory=5, batch=2)
    with pytest.raises(ValueError, match="size must be an int in 1..2"):
        vbs.fixed_batch_plan(worked_example, batch=2, size=3)


@pytest.mark.parametrize("seed", range(6))
def test_fbs_takes_the_largest_batch_that_fits(seed, random_branched):
    rng = np.random.default_rng(200 + seed)
    B = int(rng.integers(3, 7))
    tables = random_branched(rng, B)
    peaks = [vbs.fbs_peak(tables, batch=B, size=s) for s in range(1, B + 1)]
    for memory in range(peaks[0], max(peaks) + 2, 3):
        p = vbs.fbs(tables, memory=memory, batch=B)
        size = p.max_batch_used
        assert p.peak <= memory and p.peak == peaks[size - 1]
        assert all(peaks[s - 1] > memory for s in range(size + 1, B + 1))
        assert all(sum(bs) == B and max(bs) == size for bs in p.layer_batches.values())
        g = vbs.greedy_vbs(tables, memory=memory, batch=B) if memory >= peaks[-1] else None
        if g is not None:  # with room for the whole request at once, both run it in one phase
            assert g.time_per_sample == pytest.approx(p.time_per_sample)
