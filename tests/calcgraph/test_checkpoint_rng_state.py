"""A checkpointed program's plan counts the CPU generator state torch.utils.checkpoint keeps per segment
(5,056 bytes each, made without a dispatched op, so fake tensors did not see it), before and after calibration,
against the allocator (`AllocatorMeter`), and the trace leaves torch's RNG functions as it found them."""

import torch
from torch import nn

from workbench.calcgraph import CompiledGraph, training_program
from workbench.checkpoint import sc
from workbench.measure import AllocatorMeter


def _mlp() -> nn.Module:
    return sc(nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(32, 32), nn.ReLU())], nn.Linear(32, 10)))


def _program(size, tracker):
    return training_program(_mlp, (32,), size, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                            device=torch.device("cpu"), steps=2, annotate=tracker)


def test_the_plan_counts_each_checkpointed_segments_generator_state():
    get, put = torch.get_rng_state, torch.set_rng_state
    graph = CompiledGraph(_program, device=torch.device("cpu"), input_shape=(32,))
    assert (torch.get_rng_state, torch.set_rng_state) == (get, put)
    state = torch.get_rng_state().numel()
    assert sum(c for _, _, c in _mlp().plan.segments) >= 2
    for batch in (4, 16):
        with AllocatorMeter("cpu") as meter:
            _program(batch, None)
        assert graph.required_bytes(batch) == meter.peak_bytes, batch
    calibrated = CompiledGraph(_program, device=torch.device("cpu"), input_shape=(32,))
    calibrated.calibrate(sizes=(1, 2, 4), check=(8,))
    with AllocatorMeter("cpu") as meter:
        _program(16, None)
    assert abs(calibrated.required_bytes(16) - meter.peak_bytes) < state
