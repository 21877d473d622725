"""Bad arguments to the library that the issue 23 probe battery found unhandled: each is refused with an
error naming the argument and the value, before torch fails somewhere inside (or aborts with C++ frames);
and from issue 35, a lazily planned sc() that fixed its plan on an empty first batch."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from workbench import vbs
from workbench.calcgraph import plan_training
from workbench.checkpoint import plan_checkpoints, sc
from workbench.checkpoint.profile import profile_layers
from workbench.measure import (
    AllocatorMeter, MemoryMeter, check_device, format_bytes, measure_training_step, state_bytes, time_callable,
    time_interleaved,
)
from workbench.models import build
from workbench.models.mlp import MLP

NAN = float("nan")


def tiny() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 4))


# ------------------------------------------------------------------ devices
@pytest.mark.parametrize("device, needle", [
    ("banana", "'banana'"), ("mps", "got mps"), (5, "5"), ("", "''"),
    pytest.param("cuda:7", "cuda", marks=pytest.mark.skipif(torch.cuda.device_count() > 7, reason="has cuda:7")),
])
def test_check_device_names_the_value(device, needle):
    with pytest.raises((ValueError, TypeError), match="device") as info:
        check_device(device, "probe")
    assert needle in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the CUDA device is valid")
def test_cuda_refused_without_cuda_everywhere_before_torch_asserts():
    """AllocatorMeter('cuda') raised torch's AssertionError; plan_training(device='cuda') aborted the
    interpreter (C++ frames, probe cg-device-cuda-absent)."""
    for call in (lambda: AllocatorMeter("cuda"), lambda: MemoryMeter("cuda"),
                 lambda: plan_training(tiny, [3, 4], device="cuda", calibrate=False),
                 lambda: measure_training_step(tiny(), torch.randn(2, 3, 4), torch.zeros(2, dtype=torch.long),
                                               device="cuda")):
        with pytest.raises(ValueError, match="CUDA is not available"):
            call()


def test_unknown_device_named_by_plan_measure_layers_and_training_step():
    with pytest.raises(ValueError, match="'banana'"):
        plan_training(tiny, [3, 4], device="banana", calibrate=False)
    with pytest.raises(ValueError, match="'banana'"):
        vbs.measure_layers(tiny(), torch.randn(3, 4), 2, device="banana")
    with pytest.raises(ValueError, match="'banana'"):
        measure_training_step(tiny(), torch.randn(2, 3, 4), torch.zeros(2, dtype=torch.long), device="banana")


# ------------------------------------------------------------------ measure
@pytest.mark.parametrize("call, needles", [
    (lambda: time_callable(None), ["fn", "None"]), (lambda: time_callable(5), ["fn", "5"]),
    (lambda: time_interleaved([lambda: None]), ["fns", "list"]),
    (lambda: time_interleaved({"a": 5}), ["fns['a']", "5"]),
    (lambda: format_bytes("12"), ["'12'"]), (lambda: state_bytes(5), ["model", "int"]),
    (lambda: state_bytes(tiny(), optimizer="adam"), ["optimizer", "str"]),
])
def test_measure_refuses_naming_the_value(call, needles):
    with pytest.raises(TypeError) as info:
        call()
    assert all(n in str(info.value) for n in needles), str(info.value)


def test_format_bytes_nonfinite_is_text_not_a_crash():
    assert format_bytes(float("nan")) == "nan B" and format_bytes(float("inf")) == "inf B"
    assert format_bytes(1536) == "1.5 KiB"


# ------------------------------------------------------------------ calcgraph
@pytest.mark.parametrize("sample, needle", [
    (["a"], "'a'"), ([2.5, 4], "2.5"), ([NAN], "nan"), (None, "None"), ("34", "'34'"),
])
def test_plan_training_refuses_bad_shapes_naming_them(sample, needle):
    with pytest.raises((ValueError, TypeError), match="sample_input") as info:
        plan_training(tiny, sample, calibrate=False)
    assert needle in str(info.value)


@pytest.mark.parametrize("kw, needles", [
    ({"lr": "fast"}, ["lr", "'fast'"]), ({"lr": NAN}, ["lr", "nan"]), ({"lr": -1.0}, ["lr", "-1"]),
    ({"trace_sizes": ("a", "b")}, ["trace_sizes", "'a'"]), ({"trace_sizes": (2.5, 3)}, ["trace_sizes", "2.5"]),
    ({"loss": 5}, ["loss", "5"]),
])
def test_plan_training_refuses_bad_settings_before_tracing(kw, needles):
    with pytest.raises((ValueError, TypeError)) as info:
        plan_training(tiny, [3, 4], calibrate=False, **kw)
    assert all(n in str(info.value) for n in needles), str(info.value)


def test_plan_training_names_a_factory_that_returns_no_module():
    def returns_none():
        return None

    with pytest.raises(ValueError, match="returns_none returned NoneType, not an nn.Module"):
        plan_training(returns_none, [3, 4], calibrate=False)


def test_required_bytes_refuses_batches_past_int64_and_max_batch_limit():
    graph = plan_training(tiny, [3, 4], calibrate=False)
    with pytest.raises(ValueError, match="MAX_BATCH"):
        graph.required_bytes(10**30)
    with pytest.raises(ValueError, match="limit"):
        graph.max_batch_size(1e6, margin=0.1, limit=2**50)
    assert graph.required_bytes(2**40) > graph.required_bytes(1)  # the largest allowed still sizes


# ------------------------------------------------------------------ vbs
@pytest.fixture(scope="module")
def cnn_plan():
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 3))
    layers = vbs.measure_layers(cnn, torch.randn(1, 8, 8), 4, repeats=1, min_run_time=0.0)
    return cnn, vbs.plan(layers, memory=10**7, batch=4)


def test_plan_from_json_refuses_deep_nesting_as_value_error():
    with pytest.raises(ValueError, match="Plan.from_json"):
        vbs.Plan.from_json("[" * 100000 + "]" * 100000)


def test_measure_layers_names_a_batched_sample(cnn_plan):
    cnn, _ = cnn_plan
    with pytest.raises(ValueError, match=r"sample shape \(2, 1, 8, 8\)"):
        vbs.measure_layers(cnn, torch.randn(2, 1, 8, 8), 2, repeats=1, min_run_time=0.0)


def test_run_names_inputs_of_another_shape(cnn_plan):
    cnn, plan = cnn_plan
    with pytest.raises(ValueError, match=r"inputs of shape \(4, 3, 8, 8\)"):
        vbs.run(cnn, plan, torch.randn(4, 3, 8, 8))
    json.loads(plan.to_json())  # the good plan still round-trips


# ------------------------------------------------------------------ checkpoint
def test_checkpoint_names_the_unit_that_refuses_the_sample():
    deep = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    with pytest.raises(ValueError, match=r"unit 0 \(Linear\).*sample shape \(2, 5\)"):
        sc(deep, strategy="optimal", sample=torch.randn(2, 5))
    with pytest.raises(ValueError, match=r"unit 0 \(Linear\)"):
        plan_checkpoints(deep, torch.randn(2, 5))
    with pytest.raises(TypeError, match="loss_fn"):
        profile_layers(deep, torch.randn(2, 8), loss_fn=5)


# ------------------------------------------------------------------ models
@pytest.mark.parametrize("kw, needle", [
    ({"num_classes": 2.5}, "num_classes"), ({"num_classes": 0}, "num_classes"),
    ({"in_channels": "3"}, "in_channels"), ({"in_channels": True}, "in_channels"),
])
def test_build_refuses_bad_counts_naming_them(kw, needle):
    with pytest.raises(ValueError, match=needle) as info:
        build("resnet18", **kw)
    assert repr(next(iter(kw.values()))) in str(info.value)


def test_mlp_refuses_fractional_widths_and_takes_numpy_ints():
    with pytest.raises(ValueError, match=r"2\.5"):
        MLP((784, 2.5, 10))
    import numpy as np

    assert MLP((np.int64(12), 4)).sizes == (12, 4)


# ------------------------------------------------------------------ issue 35
def test_sc_plans_on_the_batches_that_carry_data_not_on_an_empty_first_one(one_thread):
    """An empty first batch planned no checkpoints (it costs no memory) and that plan was kept for every later
    batch, whatever the budget; a plan is made on the first non-empty batch, and again on a larger one."""
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                        nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(512, 4))
    small, large = torch.randn(2, 3, 8, 8), torch.randn(8, 3, 8, 8)
    budget = plan_checkpoints(net, large, strategy="optimal").predicted_peak_bytes
    model = sc(net, memory_budget=budget, strategy="optimal")
    model(torch.randn(0, 3, 8, 8)).sum().backward()
    assert model.plan is None  # nothing to plan on
    model(small).sum().backward()
    model(large).sum().backward()
    expected = plan_checkpoints(net, large, memory_budget=budget, strategy="optimal")
    assert model.plan.segments == expected.segments and model.plan.predicted_peak_bytes <= budget
    planned = model.plan
    model(small).sum().backward()  # a smaller batch keeps the plan made on the larger one
    assert model.plan is planned
