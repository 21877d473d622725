"""workbench.vbs.schedule: steps, plans and the memory accounting the DP and the baselines share."""

import json

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


def _edit(p, change):
    d = json.loads(p.to_json())
    change(d)
    return json.dumps(d)


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


def _set_step(key, value, k=0):
    return lambda d: d["steps"][k].__setitem__(key, value)


@pytest.mark.parametrize("change,match", [
    (_set("memory", -5), r"plan 'memory' must be an int >= 0, got -5"),
    (_set("unit_bytes", 0), r"plan 'unit_bytes' must be an int >= 1, got 0"),
    (_set("batch", 0), r"plan 'batch' must be an int >= 1, got 0"),
    (_set("batch", 2.5), r"plan 'batch' must be an int >= 1, got 2.5"),
    (_set("method", "magic"), r"plan 'method' must be one of \['vbs', 'fbs', 'greedy'\], got 'magic'"),
    (lambda d: d.pop("unit_bytes"), r"missing \['unit_bytes'\]"),
    (_set("names", []), "plan 'names' must be a non-empty list"),
    (_set("steps", []), "plan 'steps' must be a non-empty list"),
    (_set_step("layer", 99), r"steps\[0\] 'layer' must be in 0..4 \(the plan's layers\), got 99"),
    (_set_step("batch", 9), r"steps\[0\] 'batch' must be in 1..4 \(the request\), got 9"),
    (_set_step("reserved", -1), r"steps\[0\] 'reserved' must be an int >= 0, got -1"),
    (_set_step("seconds", float("nan")), r"steps\[0\] 'seconds' must be a finite number >= 0, got nan"),
    (lambda d: d["steps"].pop(), r"layer 4 \('l4'\) runs \d+ samples in its steps, the request has 4"),
    (lambda d: d["steps"][2]["branches"][0].pop(0), r"steps\[2\] branch 0 step 0 'layer' must be in 0..0 \(a branch"),
    (lambda d: d["steps"][2]["branches"][0][1].update(batch=2), r"steps\[2\] branch 0: layer 1 runs 2 samples"),
    (_set("request", "mine"), r"plan 'request' must be one of \['pieces', 'kept'\], got 'mine'"),
    (_set("check", -1), r"plan 'check' must be an int >= 0, got -1"),
])
def test_plan_from_json_names_the_bad_field_and_value(random_branched, change, match):
    tables = random_branched(np.random.default_rng(3), 4)
    tables.names = [f"l{i}" for i in range(tables.n_layers)]
    p = vbs.fbs(tables, memory=10**6, batch=4)
    with pytest.raises(ValueError, match=match):
        vbs.Plan.from_json(_edit(p, change))


def test_plan_json_keeps_how_the_request_is_handed_over(random_branched):
    tables = random_branched(np.random.default_rng(3), 4)
    p = vbs.dp(tables, memory=vbs.fbs_peak(tables, batch=4, size=2) + 12, batch=4, request="kept")
    again = vbs.Plan.from_json(p.to_json())
    assert again.request == "kept" and again.check == p.check > 0 and again.steps == p.steps
    assert "request kept" in repr(again)
    # a plan saved before these were written: the paper's hand-over, its check's memory unknown
    saved = vbs.fbs(tables, memory=10**6, batch=4)
    old = vbs.Plan.from_json(_edit(saved, lambda d: [d.pop("request"), d.pop("check")]))
    assert old.request == "pieces" and old.check == 0


def test_plan_from_json_refuses_text_that_is_not_a_plan():
    with pytest.raises(ValueError, match="needs the text Plan.to_json writes"):
        vbs.Plan.from_json("{not json")
    with pytest.raises(ValueError, match="plan must be a JSON object"):
        vbs.Plan.from_json("[1, 2]")
