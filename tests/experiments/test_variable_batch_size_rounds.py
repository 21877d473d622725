"""Executed plans at toy sizes: more timed rounds while they are cheap (`min_run_time`), so one round
disturbed by other processes is not the whole measurement."""

import pytest

import workbench.experiments.variable_batch_size as exp

pytestmark = pytest.mark.usefixtures("one_thread")


def test_execute_sweep_runs_more_rounds_while_they_are_cheap():
    models, layers = exp.measure_networks(["mobilenet_v1"], image_size=16, width=0.125, max_batch=2, repeats=1)
    sweep = exp.budget_sweep(layers, requests=[2], ratios=[2.0])
    capped = exp.execute_sweep(models, sweep, image_size=16, repeats=1, min_run_time=60.0)
    assert all(len(r) == 10 for r in capped[capped.feasible].rounds)  # at most 10 x repeats
    exact = exp.execute_sweep(models, sweep, image_size=16, repeats=2)
    assert all(len(r) == 2 for r in exact[exact.feasible].rounds)
