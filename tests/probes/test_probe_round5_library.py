"""Hostile inputs, round 5 (issue 43), library family: `workbench.timing` (time_callable, time_interleaved,
calls_for, kernel_seconds), `workbench.measure` (MemoryMeter, format_bytes, state_bytes) and `workbench.vbs`
(measure_layers, plan and its planners, run, Plan.from_json, unit_for).

Each bad argument is refused before any work with a ValueError or TypeError naming the argument (or the
function) and the value. Found by this round and fixed here: `vbs.plan(batch=True)` ended in an IndexError and
`memory=True` was planned as 1 unit; `memory=10**40` raised OverflowError; `measure_layers` took `batch_sizes=True`
as 1, said "'float' object is not iterable" for 2.5 and "cannot convert float NaN" for [1, nan], ran out of memory
on 10**12, and a model that is not a module ended in AttributeError; `vbs.run` took `check='no'` and
`measure_memory='no'` as True, blamed `measure_memory` for inputs of the wrong type, ended in torch's comparison
error for `rtol=-1`/`nan` and in `add_()` for `atol='x'`; `unit_for` said "cannot convert float NaN";
`time_interleaved` took `rotate='no'`, `progress='no'` and `desc=5`; inputs holding NaN or inf made `vbs.run`
raise ExecutionMismatch blaming torch.fx's trace (NaN never compares close), now a ValueError saying the
model's own output is NaN; `MemoryMeter` took trace='no' and allocator='no' as True.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from probe_cases import refused
from torch import nn

from workbench import vbs
from workbench.measure import MemoryMeter, calls_for, format_bytes, state_bytes, time_callable, time_interleaved
from workbench.timing import kernel_seconds

NAN, INF = float("nan"), float("inf")


def noop():
    return None




# ------------------------------------------------------------------ timing


@pytest.mark.parametrize("kw, needles", [
    ({"warmup": -1}, ["warmup", "-1"]), ({"warmup": 1.5}, ["warmup", "1.5"]), ({"warmup": True}, ["warmup", "True"]),
    ({"warmup": "1"}, ["warmup", "'1'"]), ({"warmup": None}, ["warmup", "None"]),
    ({"repeats": 0}, ["repeats", "0"]), ({"repeats": NAN}, ["repeats", "nan"]),
    ({"repeats": None}, ["repeats", "None"]),
    ({"repeats": -5}, ["repeats", "-5"]), ({"repeats": 2.0}, ["repeats", "2.0"]),
    ({"device": "tpu"}, ["time_callable", "'tpu'"]), ({"device": 3}, ["time_callable", "3"]),
    ({"device": "meta"}, ["time_callable", "meta"]), ({"device": "cuda:x"}, ["time_callable", "'cuda:x'"]),
])
def test_time_callable_refuses_bad_counts_and_devices(kw, needles):
    calls = []
    refused(lambda: time_callable(lambda: calls.append(1), **kw), needles)
    assert not calls  # refused before the first call


@pytest.mark.parametrize("fn", ["noop", b"x", [noop], 3.5])
def test_time_callable_refuses_what_cannot_be_called(fn):
    refused(lambda: time_callable(fn), ["time_callable: fn", repr(fn)])


@pytest.mark.parametrize("kw, needles", [
    ({"warmup": -1}, ["warmup", "-1"]), ({"repeats": 0}, ["repeats", "0"]), ({"calls": 0}, ["calls", "0"]),
    ({"calls": 2.0}, ["calls", "2.0"]), ({"calls": True}, ["calls", "True"]),
    ({"device": "meta"}, ["time_interleaved", "meta"]), ({"device": "banana"}, ["time_interleaved", "'banana'"]),
    ({"rotate": "no"}, ["rotate", "'no'"]), ({"progress": "no"}, ["progress", "'no'"]), ({"desc": 5}, ["desc", "5"]),
])
def test_time_interleaved_refuses_bad_settings_before_timing(kw, needles):
    calls = []
    refused(lambda: time_interleaved({"a": lambda: calls.append(1)}, **kw), needles)
    assert not calls


@pytest.mark.parametrize("fns, needles", [
    ({}, ["fns is empty"]), (None, ["fns", "NoneType"]), ("ab", ["fns", "str"]),
    ({"a": noop, "b": None}, ["fns['b']", "None"]), ({1: "x"}, ["fns[1]", "'x'"]),
])
def test_time_interleaved_refuses_bad_mappings(fns, needles):
    refused(lambda: time_interleaved(fns), needles)


@pytest.mark.parametrize("sample_s, needles", [
    (0, ["sample_s", "0"]), (-1.0, ["sample_s", "-1.0"]), (NAN, ["sample_s", "nan"]), (INF, ["sample_s", "inf"]),
    ("1", ["sample_s", "'1'"]), (True, ["sample_s", "True"]), (None, ["sample_s", "None"]),
])
def test_calls_for_refuses_bad_seconds(sample_s, needles):
    refused(lambda: calls_for(noop, sample_s), needles)


@pytest.mark.parametrize("kw, needles", [
    ({"calls": 0}, ["calls", "0"]), ({"calls": 1.5}, ["calls", "1.5"]), ({"warmup": -1}, ["warmup", "-1"]),
    ({"device": "tpu"}, ["kernel_seconds", "'tpu'"]), ({"device": 0}, ["kernel_seconds", "0"]),
])
def test_kernel_seconds_refuses_bad_settings_before_profiling(kw, needles):
    refused(lambda: kernel_seconds(noop, **kw), needles)


def test_kernel_seconds_refuses_what_cannot_be_called():
    refused(lambda: kernel_seconds(5), ["kernel_seconds: fn", "5"])


# ------------------------------------------------------------------ measure


@pytest.mark.parametrize("value", [None, True, 1j, [1], torch.tensor(5), __import__("decimal").Decimal(5), b"12"])
def test_format_bytes_refuses_what_is_not_a_number(value):
    refused(lambda: format_bytes(value), ["format_bytes", repr(value)], types=(TypeError,))


@pytest.mark.parametrize("value, shown", [(-INF, "-inf B"), (-2048, "-2.0 KiB"), (0, "0 B"), (np.int64(3 * 2**30),
                                                                                             "3.0 GiB")])
def test_format_bytes_answers_edge_numbers_as_text(value, shown):
    assert format_bytes(value) == shown


@pytest.mark.parametrize("model, optimizer, needles", [
    (None, None, ["model", "NoneType"]), (torch.zeros(3), None, ["model", "Tensor"]),
    (nn.Linear(2, 2), nn.Linear(2, 2), ["optimizer", "Linear"]), (nn.Linear(2, 2), [], ["optimizer", "list"]),
    ("model", None, ["model", "str"]),
])
def test_state_bytes_refuses_what_is_not_a_module_or_optimizer(model, optimizer, needles):
    refused(lambda: state_bytes(model, optimizer), needles, types=(TypeError,))


@pytest.mark.parametrize("device, needles", [
    ("tpu", ["MemoryMeter", "'tpu'"]), (0, ["MemoryMeter", "0"]), ("meta", ["MemoryMeter", "meta"]),
    (["cpu"], ["MemoryMeter", "['cpu']"]), ("cpu:x", ["MemoryMeter", "'cpu:x'"]),
])
def test_memory_meter_refuses_bad_devices(device, needles):
    refused(lambda: MemoryMeter(device), needles)


@pytest.mark.parametrize("kw", [{"trace": "no"}, {"allocator": "no"}])
def test_memory_meter_refuses_flags_that_are_not_bools(kw):
    refused(lambda: MemoryMeter("cpu", **kw), [next(iter(kw)), "'no'"])


def test_memory_meter_entered_twice_is_refused_and_leaves_no_mode_behind():
    meter = MemoryMeter("cpu")
    with meter:
        with pytest.raises(RuntimeError, match="already measuring"):
            meter.__enter__()
    with MemoryMeter("cpu") as again:
        torch.zeros(4)
    assert again.peak_bytes == 16


# ------------------------------------------------------------------ vbs


@pytest.fixture(scope="module")
def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))


@pytest.fixture(scope="module")
def layers(cnn):
    return vbs.measure_layers(cnn, torch.randn(1, 4, 4), 4, repeats=1, min_run_time=0.0)


@pytest.fixture(scope="module")
def kept_plan(layers):
    return vbs.plan(layers, memory=10**7, batch=4, request="kept")


@pytest.mark.parametrize("kw, needles", [
    ({"memory": -1}, ["memory", "-1"]), ({"memory": NAN}, ["memory", "nan"]), ({"memory": INF}, ["memory", "inf"]),
    ({"memory": "1e7"}, ["memory", "'1e7'"]), ({"memory": 2.5e6}, ["memory", "2500000.0"]),
    ({"memory": True}, ["memory", "True"]), ({"memory": 10**40}, ["memory", str(10**40), "2**63-1"]),
    ({"memory": None}, ["memory"]),
    ({"batch": 0}, ["batch", "1..4", "0"]), ({"batch": -2}, ["batch", "-2"]), ({"batch": 2.5}, ["batch", "2.5"]),
    ({"batch": "4"}, ["batch", "'4'"]), ({"batch": True}, ["batch", "True"]), ({"batch": 5}, ["batch", "1..4", "5"]),
    ({"batch": None}, ["batch", "None"]), ({"batch": np.float64(2)}, ["batch", "2.0"]),
    ({"resolution": 0}, ["resolution", "0"]), ({"resolution": -5}, ["resolution", "-5"]),
    ({"resolution": 2.5}, ["resolution", "2.5"]), ({"resolution": "9"}, ["resolution", "'9'"]),
    ({"request": "all"}, ["request", "'all'", "pieces"]), ({"request": None}, ["request", "None"]),
])
def test_plan_refuses_bad_budgets_batches_and_settings(layers, kw, needles):
    args = {"memory": 10**7, "batch": 4, **kw}
    refused(lambda: vbs.plan(layers, **args), needles)


@pytest.mark.parametrize("planner", ["dp", "fbs", "greedy_vbs", "least_memory_plan"])
@pytest.mark.parametrize("kw, needles", [({"memory": -3}, ["memory", "-3"]), ({"batch": 9}, ["batch", "9"]),
                                         ({"batch": True}, ["batch", "True"])])
def test_every_planner_refuses_the_same_bad_request(layers, planner, kw, needles):
    args = {"memory": 10**3, "batch": 4, **kw}
    refused(lambda: getattr(vbs, planner)(layers, **args), needles)


@pytest.mark.parametrize("tables", [{"a": 1}, None, "layers", np.zeros((2, 4))])
def test_plan_refuses_tables_that_are_not_a_layer_profile(tables):
    refused(lambda: vbs.plan(tables, memory=10**7, batch=4), ["LayerProfile", type(tables).__name__])


@pytest.mark.parametrize("call, needles", [
    (lambda p: vbs.smallest_budget(p, batch=0), ["batch", "0"]),
    (lambda p: vbs.smallest_budget(p, batch=4, method="bogus"), ["method", "'bogus'"]),
    (lambda p: vbs.smallest_budget(p, batch=4, request="bogus"), ["request", "'bogus'"]),
    (lambda p: vbs.fixed_batch_plan(p, batch=4, size=0), ["size", "0"]),
    (lambda p: vbs.fixed_batch_plan(p, batch=4, size=5), ["size", "5"]),
    (lambda p: vbs.fixed_batch_plan(p, batch=4, size=2.5), ["size", "2.5"]),
    (lambda p: vbs.fbs_peak(p, batch=4, size=-1), ["size", "-1"]),
])
def test_budget_and_baseline_helpers_refuse_bad_sizes(layers, call, needles):
    refused(lambda: call(layers), needles)


@pytest.mark.parametrize("batch_sizes", [0, -3, 2.5, "4", True, [2, 4], [1, 4, 2], [1, 2, 2], [], [1, NAN],
                                         10**12, [1, 2.0], None, {1: 1}])
def test_measure_layers_refuses_bad_batch_sizes_before_measuring(cnn, batch_sizes):
    refused(lambda: vbs.measure_layers(cnn, torch.randn(1, 4, 4), batch_sizes, repeats=1, min_run_time=0.0),
             ["batch_sizes", repr(batch_sizes)[:20]])


@pytest.mark.parametrize("kw, needles", [
    ({"warmup": -1}, ["warmup", "-1"]), ({"repeats": 0}, ["repeats", "0"]), ({"repeats": 1.5}, ["repeats", "1.5"]),
    ({"statistic": "mean"}, ["statistic", "'mean'"]), ({"min_run_time": -1}, ["min_run_time", "-1"]),
    ({"min_run_time": NAN}, ["min_run_time", "nan"]), ({"min_run_time": INF}, ["min_run_time", "inf"]),
    ({"min_run_time": "0"}, ["min_run_time", "'0'"]), ({"device": "meta"}, ["measure_layers", "meta"]),
])
def test_measure_layers_refuses_bad_settings(cnn, kw, needles):
    refused(lambda: vbs.measure_layers(cnn, torch.randn(1, 4, 4), 2, **kw), needles)


@pytest.mark.parametrize("model", ["cnn", lambda x: x, None, torch.zeros(2)])
def test_measure_layers_refuses_a_model_that_is_not_a_module(model):
    refused(lambda: vbs.measure_layers(model, torch.randn(1, 4, 4), 2), ["model", "nn.Module"], types=(TypeError,))


@pytest.mark.parametrize("sample, needles", [
    ([[1.0]], ["sample"]), (torch.randn(2, 4, 4), ["sample shape (2, 4, 4)"]),
    (torch.randn(0, 4, 4), ["sample shape (0, 4, 4)"]),
    (torch.zeros(1, 4, 4, dtype=torch.long), ["sample shape (1, 4, 4)", "long"]),
    (torch.tensor(1.0), ["sample"]),
])
def test_measure_layers_names_a_sample_the_model_cannot_take(cnn, sample, needles):
    refused(lambda: vbs.measure_layers(cnn, sample, 2, repeats=1, min_run_time=0.0), needles)


@pytest.mark.parametrize("make, needles", [
    (lambda m, p: vbs.run(m, None, torch.randn(4, 1, 4, 4)), ["plan", "NoneType"]),
    (lambda m, p: vbs.run(m, {"a": 1}, torch.randn(4, 1, 4, 4)), ["plan", "dict"]),
    (lambda m, p: vbs.run("cnn", p, torch.randn(4, 1, 4, 4)), ["model", "'cnn'"]),
    (lambda m, p: vbs.run(m, p, "x"), ["inputs", "str"]),
    (lambda m, p: vbs.run(m, p, np.zeros((4, 1, 4, 4), np.float32)), ["inputs", "ndarray"]),
    (lambda m, p: vbs.run(m, p, [torch.randn(1, 1, 4, 4), "x"], measure_memory=False), ["inputs", "list"]),
    (lambda m, p: vbs.run(m, p, torch.randn(3, 1, 4, 4)), ["request of 4 samples", "got 3"]),
    (lambda m, p: vbs.run(m, p, torch.randn(5, 1, 4, 4)), ["request of 4 samples", "got 5"]),
    (lambda m, p: vbs.run(m, p, torch.zeros(4, 1, 4, 4, dtype=torch.long)), ["inputs of shape (4, 1, 4, 4)"]),
    (lambda m, p: vbs.run(m, p, torch.randn(4, 1, 4, 4), rtol=-1.0), ["rtol", "-1.0"]),
    (lambda m, p: vbs.run(m, p, torch.randn(4, 1, 4, 4), rtol=NAN), ["rtol", "nan"]),
    (lambda m, p: vbs.run(m, p, torch.randn(4, 1, 4, 4), atol="x"), ["atol", "'x'"]),
    (lambda m, p: vbs.run(m, p, torch.randn(4, 1, 4, 4), atol=INF), ["atol", "inf"]),
    (lambda m, p: vbs.run(m, p, torch.randn(4, 1, 4, 4), check="no"), ["check", "'no'"]),
    (lambda m, p: vbs.run(m, p, torch.randn(4, 1, 4, 4), check_memory="no"), ["check_memory", "'no'"]),
    (lambda m, p: vbs.run(m, p, torch.randn(4, 1, 4, 4), measure_memory="no"), ["measure_memory", "'no'"]),
    (lambda m, p: vbs.run(nn.Sequential(nn.Flatten(), nn.Linear(16, 3)), p, torch.randn(4, 1, 4, 4)),
     ["plan was made for layers"]),
])
def test_run_refuses_bad_arguments_before_executing(cnn, kept_plan, make, needles):
    refused(lambda: make(cnn, kept_plan), needles)


@pytest.mark.parametrize("value", [NAN, INF])
def test_run_names_nan_outputs_rather_than_blaming_the_trace(cnn, kept_plan, value):
    """Inputs holding NaN (or inf, whose products are NaN) raised ExecutionMismatch blaming torch.fx's trace of the
    model: NaN outputs never compare close."""
    inputs = torch.randn(4, 1, 4, 4)
    inputs[2, 0, 1, 1] = value
    with pytest.raises(ValueError, match="model\\(x\\) is NaN for sample 2 .*check=False"):
        vbs.run(cnn, kept_plan, inputs)
    assert vbs.run(cnn, kept_plan, inputs, check=False).outputs.shape == (4, 3)


@pytest.mark.parametrize("text, needles", [
    ("not json", ["Plan.from_json"]), ("[]", ["JSON object", "list"]), ("{}", ["missing"]),
    (None, ["Plan.from_json", "NoneType"]), ('"plan"', ["JSON object", "str"]),
])
def test_plan_from_json_refuses_what_to_json_did_not_write(text, needles):
    refused(lambda: vbs.Plan.from_json(text), needles, types=(ValueError,))


@pytest.mark.parametrize("old, new, needles", [
    ('"batch": 4', '"batch": NaN', ["'batch'", "nan"]), ('"batch": 4', '"batch": -4', ["'batch'", "-4"]),
    ('"batch": 4', '"batch": "4"', ["'batch'", "'4'"]), ('"batch": 4', '"batch": true', ["'batch'", "True"]),
])
def test_plan_from_json_refuses_edited_counts(kept_plan, old, new, needles):
    text = kept_plan.to_json()
    assert old in text
    refused(lambda: vbs.Plan.from_json(text.replace(old, new)), needles, types=(ValueError,))


@pytest.mark.parametrize("bytes_value, units, needles", [
    (NAN, 10, ["bytes_value", "nan"]), (100.0, 0, ["units", "0"]), (-5.0, 10, ["bytes_value", "-5.0"]),
    ("5", 10, ["bytes_value", "'5'"]), (100.0, 2.5, ["units", "2.5"]), (INF, 10, ["bytes_value", "inf"]),
])
def test_unit_for_refuses_bad_sizes(bytes_value, units, needles):
    refused(lambda: vbs.unit_for(bytes_value, units), needles, types=(ValueError,))


def test_the_good_calls_still_answer(cnn, layers, kept_plan):
    assert time_callable(noop, warmup=0, repeats=1).median_s >= 0
    assert set(time_interleaved({"a": noop}, repeats=1, rotate=True)) == {"a"}
    assert vbs.unit_for(10 * 2**20, 10) == 2**20
    assert vbs.plan(layers, memory=np.int64(10**7), batch=np.int64(4)).batch == 4
    assert vbs.measure_layers(cnn, torch.randn(1, 4, 4), [1, 2, 4], repeats=1, min_run_time=0.0).max_batch == 4
    result = vbs.run(cnn, kept_plan, torch.randn(4, 1, 4, 4), rtol=1e-4, atol=1e-5)
    assert result.outputs.shape == (4, 3) and math.isfinite(result.seconds)
