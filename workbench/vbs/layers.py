"""Per-layer tables: time(i, b), in(i, b), out(i, b), ws(i, b) (Table I of the paper).

From "Variable batch size across layers for efficient prediction on CNNs" (Choudhury et al.),
Sections III and IV ("Implementation details"): the dynamic program takes, for every layer L_i
and batch size b = 1..B, the per-sample time, the input and output activation memory and the
temporary (workspace) memory, held in a `LayerProfile`. `measure_layers` measures them on a real
model: every batch size is first warmed by a pass of the whole network (so that no layer's first
call at a new shape is timed), then each layer group (a convolution with its BatchNorm and ReLU) is
timed in rounds that interleave the batch sizes (median of the rounds, divided by b) and its memory
is read from the device's allocator (as `workbench.measure.AllocatorMeter` reads it):
`in` = bytes of the input batch, `out` = bytes of the output, `ws` = the allocator's peak while
the layer runs minus its output. On CUDA that is `max_memory_allocated` (cuDNN's workspace
included, as the paper's `CUDNN_LOGINFO_DBG`); on CPU the c10 allocator's own events, which see
the scratch a kernel allocates inside itself (oneDNN's convolution buffers, often larger than the
layer's output) that a count of tensors misses.

A branch group (special layer, see `workbench.vbs.graph`) gets a main-path row whose `in` and
`out` are the group's input and merged output, whose `ws` is 0 (branches write into a
pre-allocated output), and whose `time` is the merge overhead (measured group time minus the sum
of its branch layers, at least 0); its branches are LayerProfiles of their own in `branches[i]`.
Following the paper, a branch's first layer has `in = 0` (its input is the group's input,
already reserved); unlike the paper, the last layer keeps its `out`, because in PyTorch that
output is a tensor of its own until it is copied into the group's output.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from torch import nn

from ..measure import allocator_events, allocator_trace, check_device, time_callable
from .graph import run_stages, stages_of

__all__ = ["LayerProfile", "measure_layers", "unit_for"]


def _table(name: str, value, shape: tuple[int, ...] | None, *, integer: bool) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be a 2-D table [layer, batch-1], got shape {arr.shape}")
    if shape is not None and arr.shape != shape:
        raise ValueError(f"{name} has shape {arr.shape}; all tables must have shape {shape}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{name} must be finite and >= 0")
    if integer:
        if np.any(arr != np.round(arr)):
            raise ValueError(f"{name} must hold whole memory units; use LayerProfile.coarsen to change units")
        return arr.astype(np.int64)
    return arr


@dataclass(eq=False)
class LayerProfile:
    """Per-layer tables indexed `[layer, batch - 1]` for batch sizes 1..B.

    `time` is seconds per sample; `inp`, `out`, `ws` are whole memory units of `unit_bytes`
    bytes each. `branches` maps the index of a special (branch-group) layer to one LayerProfile per
    branch (a branch may have no layers: an identity shortcut). `merge` maps it to "cat"/"add".
    """

    time: np.ndarray
    inp: np.ndarray
    out: np.ndarray
    ws: np.ndarray
    names: list[str] | None = None
    branches: dict[int, list[LayerProfile]] = field(default_factory=dict)
    unit_bytes: int = 1
    merge: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.time = _table("time", self.time, None, integer=False)
        shape = self.time.shape
        self.inp = _table("inp", self.inp, shape, integer=True)
        self.out = _table("out", self.out, shape, integer=True)
        self.ws = _table("ws", self.ws, shape, integer=True)
        if shape[1] < 1:
            raise ValueError("tables need at least one batch size (B >= 1)")
        n = shape[0]
        self.names = list(self.names) if self.names is not None else [f"L{i + 1}" for i in range(n)]
        if len(self.names) != n:
            raise ValueError(f"{len(self.names)} names for {n} layers")
        if not isinstance(self.unit_bytes, int) or self.unit_bytes < 1:
            raise ValueError(f"unit_bytes must be an int >= 1, got {self.unit_bytes!r}")
        for i, parts in self.branches.items():
            if not 0 <= i < n:
                raise ValueError(f"branch layer index {i} outside 0..{n - 1}")
            for p in parts:
                if p.max_batch != self.max_batch or p.unit_bytes != self.unit_bytes or p.branches:
                    raise ValueError(f"branch of layer {i}: needs B={self.max_batch}, "
                                     f"unit_bytes={self.unit_bytes} and no nested branches")

    @property
    def n_layers(self) -> int:
        return self.time.shape[0]

    @property
    def max_batch(self) -> int:
        return self.time.shape[1]

    def is_special(self, i: int) -> bool:
        return i in self.branches

    def coarsen(self, unit_bytes: int) -> LayerProfile:
        """The same tables in units of `unit_bytes` bytes (memory rounded up, never down)."""
        if not isinstance(unit_bytes, int) or unit_bytes < self.unit_bytes or unit_bytes % self.unit_bytes:
            raise ValueError(f"unit_bytes must be an int multiple of the current {self.unit_bytes}, "
                             f"got {unit_bytes!r}")
        f = unit_bytes // self.unit_bytes

        def up(a: np.ndarray) -> np.ndarray:
            return -(-a // f)

        return LayerProfile(self.time, up(self.inp), up(self.out), up(self.ws), self.names,
                       {i: [p.coarsen(unit_bytes) for p in ps] for i, ps in self.branches.items()},
                       unit_bytes, dict(self.merge))

    def uniform_time(self) -> np.ndarray:
        """Per-sample time of the whole network when every layer runs at batch b (b = 1..B)."""
        total = self.time.sum(axis=0)
        for parts in self.branches.values():
            for p in parts:
                total = total + p.time.sum(axis=0)
        return total

    def to_frame(self) -> pd.DataFrame:
        """One row per (layer, batch): time per sample, in/out/ws in units and bytes."""
        rows = []
        for i, name in enumerate(self.names):
            for b in range(1, self.max_batch + 1):
                rows.append({"layer": i, "name": name, "special": self.is_special(i), "batch": b,
                             "time_per_sample_s": self.time[i, b - 1], "in": self.inp[i, b - 1],
                             "out": self.out[i, b - 1], "ws": self.ws[i, b - 1]})
        frame = pd.DataFrame(rows)
        for col in ("in", "out", "ws"):
            frame[f"{col}_bytes"] = frame[col] * self.unit_bytes
        return frame

    def to_dict(self) -> dict:
        return {"max_batch": self.max_batch, "time": self.time.tolist(), "inp": self.inp.tolist(),
                "out": self.out.tolist(), "ws": self.ws.tolist(), "names": self.names, "unit_bytes": self.unit_bytes,
                "merge": {str(k): v for k, v in self.merge.items()},
                "branches": {str(k): [p.to_dict() for p in v] for k, v in self.branches.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> LayerProfile:
        B = int(data["max_batch"])
        tab = {k: np.asarray(data[k], dtype=np.float64).reshape(-1, B) for k in ("time", "inp", "out", "ws")}
        return cls(tab["time"], tab["inp"], tab["out"], tab["ws"], data["names"],
                   {int(k): [cls.from_dict(p) for p in v] for k, v in data.get("branches", {}).items()},
                   int(data.get("unit_bytes", 1)), {int(k): v for k, v in data.get("merge", {}).items()})


# ---------------------------------------------------------------------------------------------
# Measuring the tables of a real model


#: The largest batch `measure_layers` measures (its tables hold one column per batch size up to B).
MAX_MEASURED_BATCH = 2**16


def _batch_list(batch_sizes: int | Sequence[int]) -> list[int]:
    def whole(b) -> bool:
        return not isinstance(b, bool) and isinstance(b, (int, np.integer)) and 1 <= b <= MAX_MEASURED_BATCH

    if whole(batch_sizes):
        sizes = list(range(1, int(batch_sizes) + 1))
    elif isinstance(batch_sizes, (list, tuple, range, np.ndarray)) and all(whole(b) for b in batch_sizes):
        sizes = [int(b) for b in batch_sizes]
    else:
        sizes = []
    if not sizes or sizes[0] != 1 or any(b <= a for a, b in zip(sizes, sizes[1:], strict=False)):
        raise ValueError(f"batch_sizes must be an int B in 1..{MAX_MEASURED_BATCH} or an increasing list of such ints "
                         f"starting at 1, got {batch_sizes!r}")
    return sizes


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Rows:
    """Measured values per layer at the measured batch sizes, filled to 1..B by interpolation."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {"time": [], "in": [], "out": [], "ws": []}

    def add(self, time: float, inp: int, out: int, ws: int) -> None:
        for k, v in zip(("time", "in", "out", "ws"), (time, inp, out, ws), strict=True):
            self.values[k].append(v)


class _Allocations:
    """The allocator's peak during each of many calls, relative to the call's start: on CUDA from
    `max_memory_allocated`, on CPU from the c10 allocator's events of one profiled pass, each call
    a `record_function` range (`peak(k)` after the `with` block).

    # NOTE: the allocator's count, not the tensor tracker's: on CPU, oneDNN's convolution scratch
    # never becomes a tensor, and without it a plan's predicted peak fell short of the executed one
    # by up to 2.6x (a 9-layer CNN at 32x32). One profiler session per pass rather than one per
    # call (`workbench.measure.AllocatorMeter`): each session start and stop is logged by the
    # profiler, thousands of lines in a notebook, and costs time.
    """

    def __init__(self, device: torch.device) -> None:
        self.device, self.peaks, self._profiler, self._profiling = device, [], None, None

    def __enter__(self) -> _Allocations:
        if self.device.type != "cuda":
            self._profiling = allocator_events("measure_layers")
            self._profiler = self._profiling.__enter__()
        return self

    def __call__(self, fn, x: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(the call's index, y = fn(x))."""
        k = len(self.peaks)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            start = torch.cuda.memory_allocated(self.device)
            y = fn(x)
            torch.cuda.synchronize(self.device)
            self.peaks.append(torch.cuda.max_memory_allocated(self.device) - start)
            return k, y
        with torch.profiler.record_function(f"workbench.vbs.call.{k}"):
            y = fn(x)
        self.peaks.append(None)
        return k, y

    def __exit__(self, *exc) -> None:
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        self._profiling.__exit__(None, None, None)
        events = profiler.profiler.kineto_results.events()
        memory = allocator_trace(profiler)
        ranges = {int(e.name().rsplit(".", 1)[1]): (e.start_ns(), e.end_ns()) for e in events
                  if e.name().startswith("workbench.vbs.call.")}
        times = [t for t, _ in memory]
        totals = np.cumsum([0] + [n for _, n in memory])  # totals[m]: live bytes before event m
        for k, (start, end) in ranges.items():
            lo, hi = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
            self.peaks[k] = int(max(totals[lo:hi + 1].max() - totals[lo], 0))

    def peak(self, k: int) -> int:
        return self.peaks[k]


class _Clock:
    """Seconds per sample of single calls, gathered per (layer key, batch size) over rounds."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[tuple, list[float]] = {}

    def __call__(self, key: tuple, fn, x: torch.Tensor) -> torch.Tensor:
        outputs = []
        timing = time_callable(lambda: outputs.append(fn(x)), warmup=0, repeats=1, device=self.device)
        self.seconds.setdefault((*key, x.shape[0]), []).append(timing.median_s / x.shape[0])
        return outputs[0]

    def value(self, key: tuple, b: int, statistic: str) -> float:
        times = self.seconds[(*key, b)]
        return float(np.median(times) if statistic == "median" else np.min(times))


def _timed_pass(stages, x: torch.Tensor, clock: _Clock) -> None:
    """One forward pass with every layer (and every branch layer, and each group whole) timed."""
    for i, stage in enumerate(stages):
        if stage.is_branch:
            for j, branch in enumerate(stage.branches):
                y = x
                for k, (_, layer) in enumerate(branch):
                    y = clock((i, j, k), layer, y)
        x = clock((i,), stage, x)


def _fill(points: list[int], rows: dict[str, list[float]], B: int, integer: bool, key: str) -> np.ndarray:
    grid = np.arange(1, B + 1)
    vals = np.interp(grid, points, rows[key])
    return np.ceil(vals).astype(np.int64) if integer else vals


@torch.no_grad()
def measure_layers(
    model: nn.Module, sample: torch.Tensor, batch_sizes: int | Sequence[int], *,
    device: torch.device | str | None = None, warmup: int = 1, repeats: int = 3, statistic: str = "median",
    min_run_time: float = 0.2, progress: bool = False,
) -> LayerProfile:
    """Measure the per-layer tables of `model` (eval mode, no grad) at batch sizes 1..B, in bytes.

    `sample` is one input without the batch dimension (e.g. 3x224x224); a batch of b is b copies.
    `batch_sizes` is B (measure every b = 1..B) or an increasing list starting at 1 whose largest
    entry is B; batch sizes in between are linearly interpolated (per-sample time and bytes).
    The model is moved to `device` (default: the sample's device) and put in eval mode.

    Timing: every batch size is first warmed (`warmup` untimed passes of the whole network), then
    rounds each run one timed pass at every batch size, the order reversed every other round; a
    layer's time at b is the `statistic` ("median", the default, or "min") of its rounds. At least
    `repeats` rounds run, more (up to 10 x `repeats`) while the rounds have taken less than
    `min_run_time` seconds, as torch.utils.benchmark's `blocked_autorange` does: small models get
    many cheap rounds, large ones exactly `repeats`.
    # NOTE: rounds interleave the batch sizes so that a burst of load from other processes (or a
    # first call the warm pass missed) lands on one round of every batch size, where the median
    # drops it, instead of on every repeat of one batch size (which once read GoogLeNet at batch 1
    # as 300x slower per image than at batch 4). On a shared, loaded CPU "min" is the least
    # disturbed estimate; the DP would otherwise exploit noise.
    """
    from tqdm.auto import tqdm

    if not isinstance(model, nn.Module):
        raise TypeError(f"measure_layers: model must be an nn.Module, got {model!r} ({type(model).__name__})")
    if not isinstance(sample, torch.Tensor) or sample.dim() < 1:
        raise TypeError("sample must be a tensor of one input without the batch dimension")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if statistic not in ("median", "min"):
        raise ValueError(f"statistic must be 'median' or 'min', got {statistic!r}")
    if not isinstance(min_run_time, (int, float)) or not 0 <= min_run_time < math.inf:
        raise ValueError(f"min_run_time must be a number of seconds >= 0, got {min_run_time!r}")
    sizes = _batch_list(batch_sizes)
    device = check_device(device, "measure_layers") if device is not None else sample.device
    model = model.to(device).eval()
    stages = stages_of(model)

    def batch(b: int) -> torch.Tensor:
        return sample.to(device).unsqueeze(0).expand(b, *sample.shape).contiguous()

    main = [_Rows() for _ in stages]
    branch_rows = {i: [[_Rows() for _ in br] for br in s.branches] for i, s in enumerate(stages) if s.is_branch}
    bar = tqdm(total=len(sizes) + repeats, desc="profiling layers", disable=not progress, leave=False)
    for b in sizes:  # warm passes, then the memory of every layer at b
        bar.set_postfix_str(f"memory at batch {b}")
        x = batch(b)
        try:
            for _ in range(warmup):
                run_stages(stages, x)
            calls = []  # (rows, in bytes, out bytes, the call, whether ws counts)
            with _Allocations(device) as alloc:
                for i, stage in enumerate(stages):
                    for j, branch in enumerate(stage.branches if stage.is_branch else ()):
                        y = x
                        for k, (_, layer) in enumerate(branch):
                            call, y_next = alloc(layer, y)
                            calls.append((branch_rows[i][j][k], 0 if k == 0 else _nbytes(y), _nbytes(y_next), call,
                                          True))
                            y = y_next
                    call, y = alloc(stage, x)
                    calls.append((main[i], _nbytes(x), _nbytes(y), call, not stage.is_branch))
                    x = y
            for rows, inp, out, call, ws in calls:
                rows.add(0.0, inp, out, max(alloc.peak(call) - out, 0) if ws else 0)
        except RuntimeError as exc:  # torch's shape errors at the first batch: name the sample's shape
            if b != sizes[0]:
                raise
            raise ValueError(f"the model refused a batch of the sample, shape {(b, *sample.shape)} (sample "
                             f"shape {tuple(sample.shape)}: one input without the batch dimension): {exc}") from exc
        bar.update()
    clock, start, r = _Clock(device), time.perf_counter(), 0
    while r < repeats or (time.perf_counter() - start < min_run_time and r < 10 * repeats):
        bar.set_postfix_str(f"timing round {r + 1}")
        for b in sizes if r % 2 == 0 else sizes[::-1]:
            _timed_pass(stages, batch(b), clock)
        bar.update(r < repeats)
        r += 1
    bar.close()
    for n, b in enumerate(sizes):
        for i, stage in enumerate(stages):
            inner = 0.0
            for j, branch in enumerate(stage.branches if stage.is_branch else ()):
                for k in range(len(branch)):
                    t = clock.value((i, j, k), b, statistic)
                    branch_rows[i][j][k].values["time"][n] = t
                    inner += t
            # a group's own time is its merge overhead: the whole group less its branch layers
            main[i].values["time"][n] = max(clock.value((i,), b, statistic) - inner, 0.0)
    B = sizes[-1]

    def build(rows: list[_Rows], names: list[str]) -> LayerProfile:
        tabs = {k: np.stack([_fill(sizes, r.values, B, k != "time", k) for r in rows]) if rows
                else np.zeros((0, B)) for k in ("time", "in", "out", "ws")}
        return LayerProfile(tabs["time"], tabs["in"], tabs["out"], tabs["ws"], names)

    result = build(main, [s.name for s in stages])
    result.branches = {i: [build(rows, [n for n, _ in stages[i].branches[j]]) for j, rows in enumerate(brs)]
                       for i, brs in branch_rows.items()}
    result.merge = {i: stages[i].merge for i in branch_rows}
    result.__post_init__()
    return result


def unit_for(bytes_value: float, units: int) -> int:
    """The unit (bytes, a whole number of KiB) that makes `bytes_value` about `units` units."""
    if (isinstance(units, bool) or not isinstance(units, (int, np.integer)) or units < 1
            or isinstance(bytes_value, bool) or not isinstance(bytes_value, (int, float, np.integer, np.floating))
            or not 0 < bytes_value < math.inf):
        raise ValueError(f"unit_for: need units >= 1 (an int) and bytes_value > 0 (a finite number), got "
                         f"units={units!r}, bytes_value={bytes_value!r}")
    return max(1024, 1024 * math.ceil(bytes_value / units / 1024))

