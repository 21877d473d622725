"""Timing calls honestly (DESIGN.md, "Measuring honestly"): wall-clock seconds after warm-up, CUDA
synchronised, and several variants interleaved round by round so that their ratios can be paired.
Re-exported by `workbench.measure`.

Beside wall time, `kernel_seconds` reads from torch.profiler how long the device itself was busy, so a
GPU time ratio can say whether it measured the GPU or the host: a step whose kernels fill under
`HOST_BOUND_SHARE` of its wall time is host-bound (`host_bound`), and its ratios time Python, the
dispatcher and kernel launches rather than the device the claim is about.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import asdict, dataclass

import torch

from .measure_args import _callable, _count, _device, _seconds

__all__ = ["HOST_BOUND", "HOST_BOUND_RULE", "HOST_BOUND_SHARE", "Timing", "calls_for", "host_bound",
           "kernel_seconds", "time_callable", "time_interleaved"]

#: Below this share of its wall time spent in device kernels, a CUDA timing measures the host.
HOST_BOUND_SHARE = 0.5
#: The verdict a GPU timing row reads instead of its rule's when it is host-bound.
HOST_BOUND = "inconclusive: host-bound"
HOST_BOUND_RULE = (f"on CUDA, '{HOST_BOUND}' where a timed step's kernels (torch.profiler) fill under "
                   f"{HOST_BOUND_SHARE:.0%} of its median wall time")


@dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of repeated calls after warm-up."""

    median_s: float
    min_s: float
    max_s: float
    times: list[float]

    def as_dict(self) -> dict:
        return asdict(self)


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def time_callable(
    fn: Callable[[], object], *, warmup: int = 1, repeats: int = 5,
    device: torch.device | str | None = None,
) -> Timing:
    """Run `fn` `warmup` times untimed, then `repeats` times timed; CUDA is synchronised.

    # NOTE: a hand-written loop rather than torch.utils.benchmark.Timer.timeit, which runs two
    # extra warm-up calls per measurement: too costly for training steps that take seconds.
    """
    warmup, repeats = _count(warmup, "warmup", 0), _count(repeats, "repeats", 1)
    _callable(fn, "time_callable: fn")
    device = _device(device, "time_callable") if device is not None else None
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return Timing(statistics.median(times), min(times), max(times), times)


def time_interleaved(
    fns: Mapping[Hashable, Callable[[], object]], *, warmup: int = 1, repeats: int = 5,
    device: torch.device | str | None = None, rotate: bool = False, progress: bool = False,
    desc: str = "timing", calls: int = 1,
) -> dict[Hashable, list[float]]:
    """Seconds per call of several callables, timed in rounds of `calls` calls in a row of each.

    # NOTE: alternating the variants within each round spreads load from other processes over
    # all of them instead of biasing one variant's times; `rotate` also shifts the order every
    # round so that no variant always runs first. Ratios of the same round can then be paired.
    # Calls of a millisecond are timed `calls` at a time: one at a time, their paired ratios spread
    # over 0.4-2.2 within one run (see `calls_for`).
    """
    from tqdm.auto import tqdm

    warmup, repeats = _count(warmup, "warmup", 0), _count(repeats, "repeats", 1)
    calls = _count(calls, "calls", 1)
    for name, flag in (("rotate", rotate), ("progress", progress)):
        if not isinstance(flag, bool):
            raise TypeError(f"time_interleaved: {name} must be True or False, got {flag!r}")
    if not isinstance(desc, str):
        raise TypeError(f"time_interleaved: desc must be a str, got {desc!r}")
    if not isinstance(fns, Mapping):
        raise TypeError(f"time_interleaved: fns must be a mapping of names to callables, got {type(fns).__name__}")
    if not fns:
        raise ValueError("time_interleaved: fns is empty; give at least one name: callable to time")
    for name, fn in fns.items():
        _callable(fn, f"time_interleaved: fns[{name!r}]")
    device = _device(device, "time_interleaved") if device is not None else None
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    def in_a_row(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(calls):
                fn()
        return run

    blocks = {name: in_a_row(fns[name]) for name in names}
    times: dict[Hashable, list[float]] = {name: [] for name in names}
    for r in tqdm(range(repeats), desc=desc, disable=not progress, leave=False):
        shift = r % len(names) if rotate and names else 0
        for name in names[shift:] + names[:shift]:
            times[name].append(time_callable(blocks[name], warmup=0, repeats=1, device=device).median_s / calls)
    return times


def calls_for(fn: Callable[[], object], sample_s: float, *, repeats: int = 1,
              device: torch.device | str | None = None) -> int:
    """How many calls of `fn` in a row last at least `sample_s` seconds, from the median of `repeats`
    timed calls (the `calls` of `time_interleaved`); at least 1."""
    sample_s = _seconds(sample_s, "calls_for: sample_s")
    once = time_callable(fn, warmup=0, repeats=repeats, device=device).median_s
    return max(1, math.ceil(sample_s / max(once, 1e-9)))


def _busy_seconds(intervals: list[tuple[int, int]]) -> float:
    """Seconds covered by the union of (start_ns, end_ns) intervals: nested or overlapping ones count once."""
    busy, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy / 1e9


def kernel_seconds(fn: Callable[[], object], *, calls: int = 1, warmup: int = 1,
                   device: torch.device | str | None = None) -> float:
    """Seconds per call during which the device ran operators, read from torch.profiler over `calls` calls
    (after `warmup` untimed ones).

    On CUDA: the union of the GPU's activity intervals (kernels, copies, memsets), so work on two streams
    at once counts once; the profiler's own cost falls on the host and does not lengthen them. Compare
    with the wall time measured without the profiler (`time_callable`, `time_interleaved`): the rest is
    the GPU waiting for the host. On CPU: the union of the intervals spent inside aten operators (the
    kernels and their dispatch), the rest being Python and autograd bookkeeping; here the host is the
    device, so `host_bound` does not apply (see there).

    # NOTE: the profiler's event list is read directly (kineto results), as `AllocatorMeter` does,
    # rather than `key_averages()`, whose per-operator sums count nested and concurrent work twice.
    """
    from torch.profiler import ProfilerActivity

    from .kineto import quiet_profile

    calls, warmup = _count(calls, "calls", 1), _count(warmup, "warmup", 0)
    _callable(fn, "kernel_seconds: fn")
    device = _device(device, "kernel_seconds") if device is not None else torch.device("cpu")
    cuda = device.type == "cuda"
    for _ in range(warmup):
        fn()
    _sync(device)
    with quiet_profile("kernel_seconds", [ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        _sync(device)
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    intervals = [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in prof.profiler.kineto_results.events()
                 if e.device_type() == kind and (cuda or e.name().startswith("aten::"))]
    return _busy_seconds(intervals) / calls


def host_bound(kernel_s: float | None, wall_s: float | None, device: torch.device | str) -> bool:
    """True where a CUDA timing is mostly host overhead: its kernels fill under `HOST_BOUND_SHARE` of its wall
    time. Never on a CPU (nor when either figure is missing).

    # NOTE: CUDA only. On a GPU the host launches kernels that run asynchronously, and a step whose kernels
    # are short leaves the GPU idle while Python, the dispatcher and the launches run: a ratio of such wall
    # times measures the host, not the device a GPU claim is about. On a CPU the same thread runs the
    # Python and the kernels; the overhead is part of what the device costs (not a waiting device), and
    # the paper's GPU claims read "other device" there anyway.
    """
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    if kind != "cuda" or kernel_s is None or wall_s is None or math.isnan(kernel_s) or math.isnan(wall_s):
        return False
    return kernel_s < HOST_BOUND_SHARE * wall_s
