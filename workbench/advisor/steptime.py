"""Timing one training step on a machine other processes share: the advisor's clock.

A step on the caller's intra-op threads (OpenMP on CPU) waits at every parallel region for its slowest
thread; when another process holds a core, the thread descheduled there stalls the whole region for a
scheduler slice. Measured on this project's shared 2-core machine at load 9.6 (an LSTM step, batch 8, 2
threads, 30 steps): median 0.14 s, worst 4.4 s, best 0.0014 s, while the same step on 1 thread took 0.002 s;
its threads had waited for a CPU 1.8x the step's wall time (median), against 0.00 on 1 thread.

So each timed sample here also reads how long the process's threads waited on a run queue (Linux's
`/proc/self/task/*/schedstat`, second field) while it ran. A sample whose threads waited more than
`STALL` of its wall time measured the other processes, not the step: it is set aside, and the step's time is
the median of the clean samples. Where too few samples come out clean within the time allowed, the median of
all is kept and the result says it is unreliable (`StepTime.reliable`; the advisor warns in its table).
Without schedstat (macOS, Windows) every sample counts as clean.

Samples are blocks of calls in a row long enough to time (`min_run_time / samples` each, as
`torch.utils.benchmark`'s blocked measurement), or single calls for steps longer than that; always at least
`samples` of them, so a step of a second is timed five times, not once.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace

import torch

__all__ = ["STALL", "StepTime", "free_memory_bytes", "pooled", "runqueue_wait", "time_parts", "time_step",
           "time_steps"]

STALL = 0.1  # a sample whose threads waited on a run queue for more than this share of its wall time is stalled


def runqueue_wait() -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a CPU (Linux), None elsewhere."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    total = 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return total / 1e9


def free_memory_bytes(device: torch.device) -> float:
    """Memory a real step may take now: CUDA's free memory, or the CPU's available memory (psutil)."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        import psutil
    except ImportError:  # psutil comes with Jupyter; without it, no limit is known
        return math.inf
    return float(psutil.virtual_memory().available)


@dataclass(frozen=True)
class StepTime:
    """Seconds per call (median of the clean samples), the calls made (warm-up included), and the samples."""

    seconds: float
    calls: int
    samples: int
    stalled: int
    part_seconds: float = math.nan  # of the part `time_step(part=...)` reads, per call (same samples)
    # seconds per call of each sample `seconds` is the median of, one per kept round: the steps of one `time_steps`
    # call keep the same rounds (a round is set aside whole), so their samples pair up round by round
    rounds: tuple[float, ...] = ()

    @property
    def reliable(self) -> bool:
        """Whether enough samples ran without their threads waiting for a CPU (see the module docstring)."""
        return self.samples - self.stalled >= max(3, self.samples // 3)


def time_step(fn: Callable[[], object], *, min_run_time: float, device: torch.device, samples: int = 5,
              most: int = 15, part: Callable[[], float] | None = None) -> StepTime:
    """Time `fn` after one warm-up call: at least `samples` samples and `min_run_time` seconds, more (up to
    `most` samples) while fewer than `samples` are clean. `part()`, where given, returns the seconds `fn` spent
    in a part of its work since `part` was last called (a step's forward): its median per call over the same
    samples is `part_seconds`, so that a part is not timed in calls of its own."""
    return time_steps([fn], min_run_time=min_run_time, device=device, samples=samples, most=most, parts=[part])[0]


def time_steps(fns: Sequence[Callable[[], object]], *, min_run_time: float, device: torch.device,
               samples: int = 5, most: int = 15, parts: Sequence[Callable[[], float] | None] | None = None
               ) -> list[StepTime]:
    """`time_step` of several steps at once, in rounds of one sample of each (the order rotated each round): what
    one step costs beyond another (the update inside backward, a checkpoint plan's recomputation) is then read
    from samples taken at the same moments. A round any of whose samples stalled is set aside whole. A sample of
    several calls follows one untimed call of the same step, as a user's steps follow each other.

    # NOTE: timed one after the other, two steps of this project's 2-core VM differed by phases of the machine
    # as well: its speed moved by a third for seconds at a time (a ViT step 27 ms, then 36 ms for 20 steps)
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    parts = [p or (lambda: math.nan) for p in (parts or [None] * len(fns))]
    calls = []
    for fn, part in zip(fns, parts, strict=True):
        sync()
        start = time.perf_counter()
        fn()  # warm-up: first-call allocations (an optimizer's state) and kernel selection
        sync()
        calls.append(max(1, math.ceil(min_run_time / samples / max(time.perf_counter() - start, 1e-9))))
        part()
    # NOTE: a block of calls after another step's follows one untimed call: the caches the other step left cold
    # cost +30% on a 0.4 ms step timed in blocks of 5
    rewarm = [len(fns) > 1 and n > 1 for n in calls]
    clean, stalled, spent = [], [], 0.0
    enabled = gc.isenabled()
    while len(clean) + len(stalled) < most and not (len(clean) >= samples and spent >= min_run_time):
        shift = (len(clean) + len(stalled)) % len(fns)
        order = list(range(len(fns)))[shift:] + list(range(len(fns)))[:shift]
        sample, late = [(0.0, 0.0)] * len(fns), False
        for i in order:
            if rewarm[i]:
                fns[i]()
            gc.disable()  # NOTE: as timeit: a collection of a large heap (a notebook's) is no part of the step
            try:
                waited = runqueue_wait()
                sync()
                start = time.perf_counter()
                for _ in range(calls[i]):
                    fns[i]()
                sync()
                wall = time.perf_counter() - start
                after = runqueue_wait()
            finally:
                if enabled:
                    gc.enable()
            spent += wall / len(fns)
            late |= waited is not None and after is not None and (after - waited) / max(wall, 1e-12) > STALL
            sample[i] = (wall / calls[i], parts[i]() / calls[i])
        (stalled if late else clean).append(sample)
    taken = len(clean) + len(stalled)
    results = []
    for i, n in enumerate(calls):
        result = StepTime(0.0, 1 + (n + rewarm[i]) * taken, taken, len(stalled))
        kept = clean if result.reliable else clean + stalled
        results.append(replace(result, seconds=statistics.median(r[i][0] for r in kept),
                               part_seconds=statistics.median(r[i][1] for r in kept),
                               rounds=tuple(r[i][0] for r in kept)))
    return results


def time_parts(run_pass: Callable[[], list[float]], *, passes: int = 5, most: int = 15) -> tuple[list[float], bool]:
    """Seconds of each part of a pass (`run_pass()` runs one pass after a warm-up and returns each part's
    seconds: the layers of a forward): the median over at least `passes` passes whose threads did not wait for
    a CPU (as `time_step`), more while fewer were clean; and whether enough were clean.

    # NOTE: what a checkpoint plan recomputes is read off these shares: single calls of each layer under load
    # gave identical transformer blocks 0.0012 s and 0.080 s, and the plan chose to recompute the "cheap" ones
    """
    run_pass()  # warm-up
    clean, stalled = [], []
    enabled = gc.isenabled()
    while len(clean) < passes and len(clean) + len(stalled) < most:
        gc.disable()
        try:
            waited, start = runqueue_wait(), time.perf_counter()
            parts = run_pass()
            wall, after = time.perf_counter() - start, runqueue_wait()
        finally:
            if enabled:
                gc.enable()
        stall = None if waited is None or after is None else (after - waited) / max(wall, 1e-12)
        (stalled if stall is not None and stall > STALL else clean).append(parts)
    reliable = len(clean) >= min(3, passes)
    kept = clean if reliable else clean + stalled
    return [statistics.median(column) for column in zip(*kept, strict=True)], reliable


def pooled(seconds: Sequence[float], keys: Sequence[Hashable]) -> list[float]:
    """Each part's seconds replaced by the median over the parts with its key: parts that do the same work (the
    same module class, parameter shapes and input shapes: identical transformer blocks) take the same time,
    which single measurements of each, on a shared machine, do not show."""
    groups: dict[Hashable, list[float]] = {}
    for key, value in zip(keys, seconds, strict=True):
        groups.setdefault(key, []).append(value)
    return [statistics.median(groups[key]) for key in keys]
