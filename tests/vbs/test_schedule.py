"""workbench.vbs.schedule: steps, plans and the memory accounting the DP and the baselines share."""

import numpy as np
import pytest

from workbench import vbs


def test_plan_json_round_trip_and_frame(random_branched):
    tables = random_branched(np.random.default_rng(3), 4)
    p = vbs.dp(tables, memory=vbs.fbs_peak(tables, batch=4, size=2) + 2, batch=4)
    again = vbs.Plan.from_json(p.to_json())
    assert again.steps == p.steps and again.layer_batches == p.layer_batches and again.method == "vbs"
    assert again.time_per_sample == p.time_per_sample and again.peak == p.peak
    frame = p.to_frame()
    assert list(frame["name"]) == tables.names
    assert (frame["unused_units"] >= 0).all()
    assert frame["seconds"].sum() == pytest.approx(p.time_per_sample * p.batch)
    assert p.peak_bytes == p.peak * tables.unit_bytes and p.max_batch_used == max(frame.batches.sum())
    assert "vbs" in repr(p)


def test_uniform_step_holds_the_group_input_and_output_while_branches_run(random_branched):
    tables = random_branched(np.random.default_rng(7), 4)
    plain = vbs.uniform_step(tables, 0, 3, reserved=5)
    assert plain.used == tables.inp[0, 2] + tables.ws[0, 2] + tables.out[0, 2] and plain.peak == 5 + plain.used
    assert plain.seconds == pytest.approx(3 * tables.time[0, 2])
    step = vbs.uniform_step(tables, 2, 3, reserved=5)
    group = int(tables.inp[2, 2] + tables.out[2, 2])
    assert step.used == group and len(step.branches) == 3 and step.branches[2] == ()
    assert all(s.reserved == 5 + group and s.batch == 3 for br in step.branches for s in br)
    assert step.branches[0][0].used == tables.branches[2][0].ws[0, 2] + tables.branches[2][0].out[0, 2]  # in = 0
    inner = sum(s.seconds for br in step.branches for s in br)
    assert step.seconds == pytest.approx(3 * tables.time[2, 2] + inner)
    assert step.peak >= step.reserved + step.used


def test_check_request(worked_example):
    vbs.check_request(worked_example, 7, 2)
    with pytest.raises(ValueError, match="batch must be an int in 1..2"):
        vbs.check_request(worked_example, 7, 3)
    with pytest.raises(ValueError, match="memory must be an int >= 0"):
        vbs.check_request(worked_example, -1, 1)
    with pytest.raises(TypeError, match="LayerProfile"):
        vbs.check_request("tables", 7, 1)
