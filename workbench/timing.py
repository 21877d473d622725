"""Timing calls honestly (DESIGN.md, "Measuring honestly"): wall-clock seconds after warm-up, CUDA
synchronised, and several variants interleaved round by round so that their ratios can be paired.
Re-exported by `workbench.measure`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import asdict, dataclass

import torch

from .measure_args import _callable, _count, _device

__all__ = ["Timing", "calls_for", "time_callable", "time_interleaved"]


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
    if not isinstance(fns, Mapping):
        raise TypeError(f"time_interleaved: fns must be a mapping of names to callables, got {type(fns).__name__}")
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
    once = time_callable(fn, warmup=0, repeats=repeats, device=device).median_s
    return max(1, math.ceil(sample_s / max(once, 1e-9)))
