"""variable_batch_size.planner: the worked example of Section III and the DP's speed."""

import numpy as np
import pytest

import workbench.experiments.variable_batch_size as exp


def test_worked_example():
    w = exp.worked_example().set_index("method")
    assert w.loc["vbs", "time_per_sample"] == pytest.approx(10.0) and w.loc["fbs", "time_per_sample"] == 12.0
    assert w.loc["vbs", "L2 batches"] == [1, 1] and w.loc["fbs", "L1 batches"] == [1, 1]
    assert w.loc["best", "chosen"] == "vbs" and w.loc["best", "time_per_sample"] == pytest.approx(10.0)
    assert (w.peak_units <= 7).all()
    assert exp.worked_example(memory=12).loc[0, "time_per_sample"] == pytest.approx(9.0)


def test_planner_timing_and_random_layers():
    t = exp.random_layers(5, 4, seed=1)
    assert t.n_layers == 5 and t.max_batch == 4 and np.all(np.diff(t.inp, axis=1) > 0)
    timing = exp.planner_timing(layers=[5, 8], memory_units=[2, 40], batch=4, repeats=1)
    assert len(timing) == 4 and set(timing.layers) == {5, 8}
    assert (timing.cpu_s >= 0).all() and (timing.median_s > 0).all()
    assert not timing[timing.memory_units == 2].feasible.any() and timing[timing.memory_units == 40].feasible.all()
