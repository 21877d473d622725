"""Hostile inputs to `plan_training` (issue 35): each refused with an error that names the bad value, before
any real step (these failed on 012f1da: `calibrate='no'` calibrated, an integer input a float model cannot
take was planned as if the step could run)."""

import pytest
import torch
from torch import nn

from workbench.calcgraph import plan_training


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 4))


def embedding_bag() -> nn.Module:
    return nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 4))


@pytest.mark.parametrize("value", ["no", "False", "auto", 0, 1, 1.0])
def test_calibrate_must_be_a_bool_or_none(value):
    with pytest.raises(TypeError, match="calibrate must be True, False or None") as refused:
        plan_training(mlp, (3, 4), calibrate=value)
    assert repr(value) in str(refused.value)


def test_calibrate_false_and_none_still_plan():
    assert plan_training(mlp, (3, 4), calibrate=False).calibration is None
    assert plan_training(mlp, (3, 4), device="cpu", calibrate=None, trace_sizes=(2, 3)).calibration is not None


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_an_input_dtype_the_model_cannot_take_is_refused_naming_it(dtype):
    x = torch.ones(2, 3, 4, dtype=dtype)
    with pytest.raises(RuntimeError):  # the real step refuses it
        mlp()(x)
    with pytest.raises(ValueError, match=rf"input \[2, 3, 4\] of {dtype}"):
        plan_training(mlp, (3, 4), input_dtype=dtype, calibrate=False)


def test_an_integer_input_the_model_can_take_is_planned():
    graph = plan_training(embedding_bag, torch.zeros(2, 3, dtype=torch.int64), calibrate=False)
    assert graph.affine and graph.required_bytes(8) > 0
