import time

import pytest
import torch
from torch import nn

from tests.conftest import requires_cuda
from workbench.measure import (
    MemoryMeter, format_bytes, measure_training_step, state_bytes, time_callable, time_interleaved,
)


def test_plain_allocations_are_exact():
    with MemoryMeter("cpu", trace=True) as meter:
        a = torch.empty(2_500_000, dtype=torch.uint8)
        b = torch.empty(10_000_000, dtype=torch.uint8)
        del a
        c = torch.empty(1_000_000, dtype=torch.uint8)
        assert meter.current_bytes == 11_000_000
    assert meter.peak_bytes == 12_500_000
    assert meter.end_bytes == 11_000_000
    assert meter.trace["bytes"].tolist() == [2_500_000, 12_500_000, 10_000_000, 11_000_000]
    del b, c


def test_tensors_from_before_entry_views_and_inplace_are_not_counted():
    x = torch.randn(1000)
    with MemoryMeter() as meter:
        x.add_(1)
        v = x.view(10, 100).t()
        x.mul_(2)
    assert meter.peak_bytes == 0
    assert v.shape == (100, 10)


def test_linear_forward_backward_matches_analytic_sizes():
    lin = nn.Linear(256, 128)
    x = torch.randn(64, 256)
    with MemoryMeter() as meter:
        y = lin(x)
        loss = y.sum()
        loss.backward()
    out, scalars, grads = 64 * 128 * 4, 2 * 4, (128 * 256 + 128) * 4  # y, loss + ones, dW + db
    assert meter.peak_bytes == out + scalars + grads
    del y, loss


def test_conv_backward_leaves_exactly_the_gradients():
    conv = nn.Conv2d(3, 8, 3, padding=1)
    x = torch.randn(4, 3, 16, 16)
    with MemoryMeter() as meter:
        conv(x).square().mean().backward()
    assert meter.end_bytes == sum(p.numel() * 4 for p in conv.parameters())
    # the forward keeps at least the conv output and its square
    assert meter.peak_bytes >= 2 * 4 * 8 * 16 * 16 * 4


def test_meter_can_be_reused_and_freed_tensors_after_exit_do_not_change_it():
    with MemoryMeter() as meter:
        t = torch.zeros(1000)
    del t
    assert meter.end_bytes == 4000
    with MemoryMeter() as meter2:
        torch.zeros(10)
    assert meter2.peak_bytes == 40 and meter2.end_bytes == 0


def test_bad_device_refused():
    with pytest.raises(ValueError, match="'cpu' and 'cuda'"):
        MemoryMeter("meta")


def test_time_callable_reports_median_of_repeats():
    calls = []
    timing = time_callable(lambda: calls.append(1), warmup=2, repeats=5)
    assert len(calls) == 7 and len(timing.times) == 5
    assert timing.min_s <= timing.median_s <= timing.max_s
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        time_callable(lambda: None, repeats=0)


def test_training_step_gradient_bytes_equal_parameter_bytes():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    record, trace = measure_training_step(
        model, torch.randn(2, 3, 8, 8), torch.tensor([0, 1]), device="cpu", trace=True, repeats=1,
    )
    assert record["grad_bytes"] == record["param_bytes"]
    assert record["peak_bytes"] == trace["bytes"].max()


def test_format_bytes():
    assert format_bytes(12) == "12 B"
    assert format_bytes(12.5 * 2**20) == "12.5 MiB"


@requires_cuda
def test_cuda_meter_agrees_with_allocator():
    dev = torch.device("cuda")
    with MemoryMeter(dev) as meter:
        a = torch.empty(2_500_000, dtype=torch.uint8, device=dev)
        b = torch.empty(10_000_000, dtype=torch.uint8, device=dev)
        del a
        c = torch.empty(1_000_000, dtype=torch.uint8, device=dev)
    # the caching allocator rounds blocks up: to 512 bytes by default, to 2 MiB segments under some
    # PYTORCH_CUDA_ALLOC_CONF settings (measured: 12 MiB on an H100 with torch 2.11)
    assert 12_500_000 <= meter.peak_bytes <= 12_500_000 + 2 * 2**20
    del b, c


def test_state_bytes_splits_parameters_gradients_and_optimizer_state():
    from workbench.measure import state_bytes

    model = nn.Linear(10, 4)
    optimizer = torch.optim.Adam(model.parameters())
    assert state_bytes(model, optimizer) == {"parameters": 176, "gradients": 0, "optimizer_state": 0}
    model(torch.randn(3, 10)).sum().backward()
    optimizer.step()
    # Adam keeps exp_avg and exp_avg_sq per parameter plus a scalar step per parameter
    assert state_bytes(model, optimizer) == {
        "parameters": 176, "gradients": 176, "optimizer_state": 2 * 176 + 2 * 4}


def test_time_interleaved_alternates_variants_and_rotates():
    from workbench.measure import time_interleaved

    calls = []
    times = time_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                             warmup=1, repeats=3)
    assert calls == ["a", "b", "a", "b", "a", "b", "a", "b"]  # warm-up, then one of each per round
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    calls.clear()
    time_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                     warmup=0, repeats=2, rotate=True)
    assert calls == ["a", "b", "b", "a"]
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        time_interleaved({"a": lambda: None}, repeats=0)


def test_time_interleaved_times_calls_in_a_row_per_call():
    from workbench.measure import calls_for, time_interleaved

    calls = []
    times = time_interleaved({"a": lambda: calls.append("a"), "b": lambda: (calls.append("b"), time.sleep(0.01))},
                             warmup=0, repeats=2, calls=3)
    assert calls == ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3
    assert all(0.01 <= t < 0.03 for t in times["b"])  # seconds per call, not per block of three
    with pytest.raises(ValueError, match="calls must be >= 1"):
        time_interleaved({"a": lambda: None}, calls=0)
    assert 2 <= calls_for(lambda: time.sleep(0.01), 0.05) <= 5 and calls_for(lambda: time.sleep(0.01), 0.001) == 1


@pytest.mark.parametrize("call, error, match", [
    (lambda: time_callable(lambda: None, repeats=2.5), TypeError, r"repeats must be an int >= 1, got 2.5 \(float\)"),
    (lambda: time_callable(lambda: None, warmup=True), TypeError, r"warmup must be an int >= 0, got True"),
    (lambda: time_callable(lambda: None, warmup=-1), ValueError, r"warmup must be >= 0, got -1"),
    (lambda: time_callable(lambda: None, device=0), TypeError, r"time_callable device must be .*got 0 \(int\)"),
    (lambda: time_interleaved({"a": lambda: None}, repeats="3"), TypeError, r"repeats must be an int >= 1, got '3'"),
    (lambda: MemoryMeter(123), TypeError, r"MemoryMeter device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, "
                                          r"got 123 \(int\)"),
    (lambda: MemoryMeter("gpu"), ValueError, r"MemoryMeter device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
    (lambda: MemoryMeter("meta"), ValueError, r"MemoryMeter supports 'cpu' and 'cuda' devices, got meta"),
])
def test_bad_arguments_name_the_value_and_what_is_allowed(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_state_bytes_counts_state_held_in_wrappers():
    """Issue 46: optimizer state kept in an object that wraps tensors (FlashOptim's int8 moments and their scales) or
    in a nested container is counted, each storage once."""
    class Wrapped:  # as FlashOptim's `_MaybeQuantizedTensor`: values and scales as attributes
        def __init__(self) -> None:
            self._quantized, self._scales, self.shape = torch.zeros(64, dtype=torch.int8), torch.zeros(2), (64,)

    model = torch.nn.Linear(8, 8, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shared = torch.zeros(4)
    opt.state[model.weight] = {"m": Wrapped(), "nested": [shared, {"again": shared}], "step": 3}
    assert state_bytes(model, opt)["optimizer_state"] == 64 + 2 * 4 + 4 * 4
