"""Kernel time beside wall time (workbench.timing): the profiler's busy time of the device, and the host-bound rule."""

import time

import pytest
import torch

from tests.conftest import requires_cuda
from workbench.timing import (HOST_BOUND_SHARE, _busy_seconds, calls_for, host_bound, kernel_seconds, time_callable,
                              time_interleaved)


def test_busy_time_counts_nested_and_overlapping_intervals_once():
    assert _busy_seconds([]) == 0
    assert _busy_seconds([(0, 10), (2, 5), (8, 14), (20, 25)]) == pytest.approx(19e-9)
    assert _busy_seconds([(20, 25), (0, 10)]) == pytest.approx(15e-9)


def test_cpu_kernel_time_is_operator_time_not_python_time(one_thread):
    a = torch.randn(256, 256)

    def operators():
        for _ in range(8):
            a @ a

    def operators_then_sleep():
        operators()
        time.sleep(0.05)  # Python, no operator: wall time the profiler must not count

    with_sleep = kernel_seconds(operators_then_sleep, calls=2)
    assert 0 < with_sleep < 0.05
    # the same operators with or without the sleep (a loaded machine stretches both alike; 3x is slack)
    assert with_sleep < 3 * kernel_seconds(operators, calls=2) + 0.01


def test_host_bound_is_a_cuda_rule_at_half_the_wall_time():
    assert host_bound(0.4, 1.0, "cuda") and host_bound(0.4, 1.0, torch.device("cuda", 0))
    assert not host_bound(HOST_BOUND_SHARE, 1.0, "cuda")
    assert not host_bound(0.1, 1.0, "cpu")  # on a CPU the host is the device
    assert not host_bound(None, 1.0, "cuda") and not host_bound(float("nan"), 1.0, "cuda")


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(TypeError, match="kernel_seconds: fn"):
        kernel_seconds(3)
    with pytest.raises(ValueError, match="calls must be >= 1"):
        kernel_seconds(lambda: None, calls=0)
    with pytest.raises(ValueError, match="time_interleaved: fns is empty"):
        time_interleaved({})
    for bad in (-1.0, 0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"calls_for: sample_s must be a finite number of seconds > 0, got {bad}"):
            calls_for(lambda: None, bad)
    with pytest.raises(TypeError, match="calls_for: sample_s must be a number"):
        calls_for(lambda: None, "1")


@requires_cuda
def test_cuda_kernel_time_sees_kernels_and_not_the_host():
    a = torch.randn(2048, 2048, device="cuda")

    def many_tiny():  # launch-bound: a few microseconds of GPU work per launch
        for _ in range(200):
            a[:1, :1].add_(1)

    def big():
        for _ in range(4):
            a @ a

    tiny_wall = time_callable(many_tiny, repeats=3, device="cuda").median_s
    assert host_bound(kernel_seconds(many_tiny, device="cuda"), tiny_wall, "cuda")
    wall = time_callable(big, repeats=3, device="cuda").median_s
    assert not host_bound(kernel_seconds(big, device="cuda"), wall, "cuda")
    assert kernel_seconds(big, device="cuda") <= 1.05 * wall
