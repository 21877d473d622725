"""Largest batch for a budget: the plan against trial-based finders under the budget guard."""

import pytest

from workbench.experiments import calcgraph as cgx


def test_plan_and_trial_bisection_agree(one_thread):
    df = cgx.max_batch_peers("mlp", 1.4 * 2**20, start_batch=64, peers=[])
    assert list(df["method"]) == ["calcgraph (plan)", "trial bisection (guard)"]
    assert df["agrees_with_truth"].all() and df["trials"].iloc[0] == 0 and df["trials"].iloc[1] > 1
    with pytest.raises(ValueError, match="peers"):
        cgx.max_batch_peers("mlp", 2**20, peers=["keras"])


def test_accelerate_finds_a_batch_that_runs(one_thread):
    pytest.importorskip("accelerate")
    df = cgx.max_batch_peers("mlp", 1.4 * 2**20, start_batch=64, peers=["accelerate"]).set_index("method")
    found = df.loc["accelerate find_executable_batch_size", "max_batch"]
    assert 1 <= found <= df.loc["trial bisection (guard)", "max_batch"]
