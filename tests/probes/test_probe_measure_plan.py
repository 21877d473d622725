"""Issue 43's hostile-input findings on the meters and plans, one test each, failing on 4414cd0: MemoryMeter
missed the tensors `torch.tensor` makes (AdamW's step counters); a factory that builds its model on the meta
device was planned as if it could train; `persistent_grads='no'` was taken as True.

# NOTE: MemoryMeter still misses the CPU generator states `torch.utils.checkpoint` keeps (5,056 B a segment): counting
# them needs a dispatched copy, an allocation the program without the meter does not make
# (tests/test_inplace_as_the_user_runs.py), and the checkpoint planner does not count them either (issue 43, open)."""

import pytest
import torch
from torch import nn

from workbench.calcgraph import plan_training
from workbench.measure import MemoryMeter


def test_the_meter_counts_a_tensor_built_from_data():
    with MemoryMeter("cpu") as meter:
        x = torch.tensor([1.0, 2.0, 3.0])
    assert meter.peak_bytes == x.untyped_storage().nbytes() == 12


def test_a_factory_that_builds_on_the_meta_device_is_refused():
    with pytest.raises(ValueError, match=r"puts 2 tensors on the meta device itself \(weight, bias\)"):
        plan_training(lambda: nn.Linear(8, 4, device="meta"), [8], calibrate=False)
    # a module given (deep-copied into fake tensors) and a factory on the default device still plan
    assert plan_training(lambda: nn.Linear(8, 4), [8], calibrate=False).required_bytes(4) > 0


@pytest.mark.parametrize("value", ["no", 1, None])
def test_persistent_grads_that_is_not_a_bool_is_refused(value):
    with pytest.raises(TypeError, match=rf"persistent_grads must be True or False, got {value!r}"):
        plan_training(lambda: nn.Linear(8, 4), [8], calibrate=False, persistent_grads=value)
