"""AllocatorMeter, the independent measure: exact on plain allocations, and MemoryMeter's tensor count
validated against it on every model family (equal where no kernel keeps scratch, below it where one does)."""

import os

import pytest
import torch
from torch import nn

from tests.conftest import requires_cuda
from workbench.kineto import without_kineto_markers
from workbench.measure import AllocatorMeter, MemoryMeter, allocator_events
from workbench.timing import kernel_seconds
from workbench.vbs import measure_layers


def _allocations(device="cpu"):
    a = torch.empty(2_500_000, dtype=torch.uint8, device=device)
    b = torch.empty(10_000_000, dtype=torch.uint8, device=device)
    del a
    c = torch.empty(1_000_000, dtype=torch.uint8, device=device)
    return b, c


def test_plain_allocations_are_counted_exactly_and_relative_to_entry():
    before = torch.empty(3_000_000, dtype=torch.uint8)  # allocated before entry, freed inside: not seen
    with AllocatorMeter("cpu") as meter:
        kept = _allocations()
        del before
    assert (meter.peak_bytes, meter.end_bytes) == (12_500_000, 11_000_000)
    assert meter.reserved_peak_bytes is None
    del kept


def test_memory_meter_reports_both_counts_from_one_block():
    with MemoryMeter("cpu", allocator=True) as meter:
        kept = _allocations()
    assert meter.peak_bytes == meter.allocator_peak_bytes == 12_500_000
    del kept
    plain = MemoryMeter("cpu")
    with plain:
        pass
    assert plain.allocator_peak_bytes is None


def _step(model, x, opt):
    def step():
        out = model(x)
        out = out[0] if isinstance(out, tuple) else out
        out.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# (model, input, kernel keeps scratch the tensor count cannot see)
FAMILIES = {
    "mlp": (lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)), (32, 64), False),
    "gru": (lambda: nn.GRU(16, 32, batch_first=True), (8, 10, 16), False),
    "transformer": (lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 1),
                    (4, 16, 32), False),
    "cnn_batchnorm": (lambda: nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                            nn.Conv2d(16, 16, 3, padding=1), nn.Flatten(),
                                            nn.Linear(16 * 32 * 32, 10)), (8, 3, 32, 32), True),
    "lstm": (lambda: nn.LSTM(16, 32, 2, batch_first=True), (8, 10, 16), True),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_count_against_the_allocator(family, one_thread):
    build, shape, scratch = FAMILIES[family]
    model = build()
    step = _step(model, torch.randn(shape), torch.optim.Adam(model.parameters()))
    step()  # steady state: optimizer state allocated
    with MemoryMeter("cpu", allocator=True) as meter:
        step()
    tensors, allocator = meter.peak_bytes, meter.allocator_peak_bytes
    assert tensors <= allocator + 64  # the tracker never sees more than the allocator hands out
    if scratch:  # the blind spot an independent measure exists for
        assert allocator > 1.05 * tensors, (tensors, allocator)
    else:
        assert allocator == pytest.approx(tensors, rel=1e-3), (tensors, allocator)


def test_bad_device_and_a_running_profiler_are_refused():
    with pytest.raises(ValueError, match="'cpu' and 'cuda'"):
        AllocatorMeter("meta")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with pytest.raises(RuntimeError, match="already running"):
            AllocatorMeter("cpu").__enter__()


@requires_cuda
def test_cuda_counts_allocated_and_reserved():
    with MemoryMeter("cuda", allocator=True) as meter:
        kept = _allocations("cuda")
    assert meter.allocator_peak_bytes == meter.peak_bytes >= 12_500_000
    assert meter.reserved_peak_bytes >= meter.peak_bytes
    del kept


def test_kineto_markers_stay_off_stderr(capfd):
    """kineto writes `USDT: ... profiler_start` / `profiler_stop` from C++ to fd 2 at every profiler start and
    stop (red stderr blocks in notebooks and reports); the meter's blocks write none of them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        pass
    raw = capfd.readouterr().err
    if "USDT:" not in raw:
        pytest.skip("this torch's kineto prints no start/stop markers: nothing to keep off stderr")
    with AllocatorMeter("cpu") as meter:
        kept = _allocations()
    with MemoryMeter("cpu", allocator=True):
        pass
    with allocator_events("calibration") as profiler:
        pass
    kernel_seconds(lambda: torch.ones(8).sum(), calls=1)  # the timing's profiler, and VBS's per-layer pass
    measure_layers(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), torch.randn(4), 2, repeats=1,
                   min_run_time=0.0)
    assert meter.peak_bytes == 12_500_000 and profiler.profiler.kineto_results is not None
    err = capfd.readouterr().err
    assert "USDT:" not in err and "profiler_st" not in err, err
    del kept


def test_only_kineto_markers_are_held_back_from_stderr(capfd):
    """What else reaches fd 2 while the profiler starts or stops (a warning, another thread's error) is
    written back, in order; only kineto's marker lines are dropped."""
    marker = b"USDT:2026-11-26 15:28:12 12885:12885 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
    with without_kineto_markers():
        os.write(2, b"first real line\n" + marker + b"ERROR: a real error, USDT: inside\n")
        os.write(2, marker.replace(b"start", b"stop") + b"no newline at the end")
    assert capfd.readouterr().err == "first real line\nERROR: a real error, USDT: inside\nno newline at the end"
    with pytest.raises(ValueError, match="inside"), without_kineto_markers():
        os.write(2, b"before the error\n")
        raise ValueError("raised inside")
    assert capfd.readouterr().err == "before the error\n"  # fd 2 restored and flushed on the way out
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with pytest.raises(RuntimeError, match="calibration needs torch.profiler, which is already running"):
            with allocator_events("calibration"):
                pass
