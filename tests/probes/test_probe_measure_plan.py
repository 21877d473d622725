"""Issue 43's hostile-input findings on the meters and plans, one test each, failing on 4414cd0: MemoryMeter
(and so `measure_required_bytes`) missed the CPU generator states `torch.utils.checkpoint` keeps and the
tensors `torch.tensor` makes (AdamW's step counters); a factory that builds its model on the meta device was
planned as if it could train; `persistent_grads='no'` was taken as True. The allocator's own count
(`AllocatorMeter`, c10's events) is the independent measure."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from workbench.calcgraph import measure_required_bytes, plan_training
from workbench.calcgraph.program import training_program
from workbench.measure import AllocatorMeter, MemoryMeter


class Checkpointed(nn.Module):
    """A block recomputed in backward (torch's own checkpoint), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(checkpoint(self.block, x, use_reentrant=False))


@pytest.mark.parametrize("batch_size", [1, 16, 64])
def test_measure_required_bytes_counts_what_checkpoint_keeps(batch_size, one_thread):
    torch.manual_seed(0)
    with AllocatorMeter(torch.device("cpu")) as allocator:
        training_program(Checkpointed, [8], batch_size)
    measured = measure_required_bytes(Checkpointed, [8], batch_size)
    # NOTE: exact at 16 and 64; at batch 1 the allocator's peak is 12 bytes higher (32,012 against 32,000 on an
    # AMD EPYC, torch 2.13): a kernel's scratch, which a count of tensors does not see by design
    assert 0 <= allocator.peak_bytes - measured <= (0 if batch_size > 1 else 16)


def test_the_meter_counts_a_tensor_built_from_data():
    with MemoryMeter("cpu") as meter:
        x = torch.tensor([1.0, 2.0, 3.0])
    assert meter.peak_bytes == x.untyped_storage().nbytes() == 12


def test_a_meter_inside_a_meter_counts_the_generator_state_once():
    with MemoryMeter("cpu") as outer:
        with MemoryMeter("cpu") as inner:
            state = torch.get_rng_state()
    assert outer.peak_bytes == inner.peak_bytes == state.numel()
    assert not hasattr(torch.get_rng_state, "_as_op")  # torch's own function is back


def test_a_factory_that_builds_on_the_meta_device_is_refused():
    with pytest.raises(ValueError, match=r"puts 2 tensors on the meta device itself \(weight, bias\)"):
        plan_training(lambda: nn.Linear(8, 4, device="meta"), [8], calibrate=False)
    # a module given (deep-copied into fake tensors) and a factory on the default device still plan
    assert plan_training(lambda: nn.Linear(8, 4), [8], calibrate=False).required_bytes(4) > 0


@pytest.mark.parametrize("value", ["no", 1, None])
def test_persistent_grads_that_is_not_a_bool_is_refused(value):
    with pytest.raises(TypeError, match=rf"persistent_grads must be True or False, got {value!r}"):
        plan_training(lambda: nn.Linear(8, 4), [8], calibrate=False, persistent_grads=value)
