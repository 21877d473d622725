"""Calibrating CalcGraph's plan against the allocator: the bytes fake tensors cannot see.

Support for Sections 3.2 and 4.3 of "CalcGraph: taming the high costs of deep learning using
models (2022)" (memory known before execution). A plan traced under fake tensors counts the
tensors each aten op returns, with the sizes the op's meta kernel reports. Real kernels can differ
in two ways: a tensor they return is larger than its meta size (oneDNN's `mkldnn_rnn_layer`
returns a workspace its meta kernel reports as 0 bytes), and they allocate scratch that is freed
before they return and never becomes a tensor (oneDNN convolution and BatchNorm buffers).

`calibrate` runs the same training program for real at a few small batch sizes under the
profiler's allocator events, with every op call marked (`record_function`), and finds for each
op call of the training steps (i) the real size of each tensor it returns, and (ii) its scratch:
the allocator's peak inside the call above its level when the call returns. Both are fitted
affine in the batch size, call by call, so that the plan predicts them at any batch size.

# NOTE: the build phase is not calibrated (a factory may take another path under fake tensors,
# see program._build_model); the training steps' op calls are matched by name (see `calibrate`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.autograd import DeviceType

from ..measure import allocator_events, allocator_trace
from .tracker import CALL_PREFIX, _Trace, _TraceError, _Tracker, _trace, collector_paused

__all__: list[str] = []  # used through CompiledGraph.calibrate


class NoAllocatorEvents(RuntimeError):
    """The profiler recorded none of the device allocator's events in a real step that allocated tensors."""


@dataclass
class _Observed:
    trace: _Trace
    scratch: np.ndarray  # per op call, bytes above the call's return level
    peak: int  # the allocator's peak over the run (what `AllocatorMeter` reads)


def _observe(program: Callable[[_Tracker], None], device: torch.device) -> _Observed:
    """One real run of `program` under the tracker and the profiler's events of `device`'s allocator."""
    if torch.autograd.profiler._is_profiler_enabled:
        raise RuntimeError("calibration needs torch.profiler, which is already running; stop it first")
    # NOTE: Python's cyclic collector paused from the profiler's start to the reading of its events (the run itself
    # collects at its marks, `_trace`): the tens of thousands of event objects read set off passes over the process's
    # whole heap, a notebook's too
    with collector_paused():
        with allocator_events("calibration", device) as profiler:  # without kineto's start/stop markers on stderr
            trace = _trace(program, fake=False, profiled=True, device=device)
        events = profiler.profiler.kineto_results.events()
        memory = allocator_trace(profiler, device)
    if not memory and len(trace.sizes) and trace.sizes.max() > 0:
        raise NoAllocatorEvents(f"calibration: torch.profiler recorded no allocator event on {device} in a "
                                f"training step that allocated {int(trace.sizes.sum())} bytes of tensors "
                                f"(torch {torch.__version__})")
    times = np.asarray([t for t, _ in memory], dtype=np.int64)
    level = np.cumsum(np.asarray([n for _, n in memory], dtype=np.int64))
    scratch = np.zeros(len(trace.calls), dtype=np.int64)
    for e in events:
        name = e.name()
        # NOTE: with CUDA's activity on, each marked call also appears on the GPU's timeline (its kernels' span,
        # another clock): only the host's range brackets the allocator's events, which the host records
        if not name.startswith(CALL_PREFIX) or e.device_type() != DeviceType.CPU:
            continue
        index = int(name[len(CALL_PREFIX):])
        lo, hi = np.searchsorted(times, e.start_ns(), "left"), np.searchsorted(times, e.end_ns(), "right")
        if hi > lo and index < len(scratch):
            scratch[index] = max(0, int(level[lo:hi].max() - level[hi - 1]))
    return _Observed(trace, scratch, int(level.max(initial=0)))


def _steps(trace: _Trace) -> tuple[int, int, list[str], tuple]:
    """First allocation and first call of the training steps, the steps' op calls and allocation ops."""
    start = trace.marks.get("step1", 0)
    first_alloc = int(sum(1 for e in trace.events[:start] if e >= 0))
    first_call = trace.call_marks.get("step1", 0)
    ops = [op for op, _ in trace.calls[first_call:]]
    allocs = tuple(trace.info[i]["op"] for i in range(first_alloc, len(trace.info)))
    return first_alloc, first_call, ops, allocs


def is_aligned(batch_size: int | np.ndarray) -> bool | np.ndarray:
    """True for a power of two: the batches whose kernels run whole tiles (see `Calibration`)."""
    b = np.asarray(batch_size, dtype=np.int64)
    out = (b > 0) & ((b & (b - 1)) == 0)
    return bool(out) if out.ndim == 0 else out


def unaligned_probe(batch_size: int) -> int | None:
    """The batch one past the power of two below `batch_size` (where a kernel's tiles pad most in its octave), None
    for a power of two: the real run that bounds `batch_size`'s envelope (`Calibration`)."""
    if is_aligned(batch_size):
        return None
    return 2 ** int(_octave(batch_size)) + 1


def _piecewise(sizes: np.ndarray, values: np.ndarray, batch_size: int, steps: bool) -> np.ndarray:
    """`values` (one row per size) at `batch_size`: linear between two neighbouring sizes and beyond the first and
    last two; with `steps`, a column that steps between two sizes (its slope there more than twice or less than
    half the slopes on both sides, or of the other sign) takes the larger of the two sizes' values there."""
    if len(sizes) == 1:
        return values[0]
    i = int(np.clip(np.searchsorted(sizes, batch_size) - 1, 0, len(sizes) - 2))
    s0, s1 = sizes[i], sizes[i + 1]
    line = values[i] + (values[i + 1] - values[i]) * (batch_size - s0) / (s1 - s0)
    if not steps or not s0 < batch_size < s1:
        return line
    slopes = np.diff(values, axis=0) / np.diff(sizes)[:, None]
    here = slopes[i]
    # a neighbouring interval's slope within a factor of 2 of this one's: the values follow a line here
    agree = [np.abs(slopes[j] - here) <= 0.5 * np.maximum(np.abs(slopes[j]), np.abs(here))
             for j in (i - 1, i + 1) if 0 <= j < len(slopes)]
    follows = np.logical_or.reduce(agree) if agree else np.ones_like(here, dtype=bool)
    return np.where(follows, line, np.maximum(values[i], values[i + 1]))


def _octave(batch_size: int | np.ndarray) -> np.ndarray:
    """k for a batch in (2**k, 2**(k + 1)]."""
    return np.ceil(np.log2(np.asarray(batch_size, dtype=np.float64))).astype(np.int64) - 1


@dataclass
class Calibration:
    """The calibrated plan: each allocation's bytes and each op call's scratch at the real runs' batch `sizes`
    (the plan's own sizes there plus what the real run showed beyond them, fitted once against the plan
    alone), affine in the batch size between two neighbouring sizes and beyond the first and last two
    (piecewise linear), except a call's scratch that steps: between two sizes where its slope is more than
    twice or less than half the slopes on both sides (or of the other sign), the larger of the two sizes'
    values.

    Where real runs were taken both at powers of two (aligned: >= 2 of them) and at other batches (unaligned), the
    line runs through the aligned ones, and at any batch b that is not a power of two each allocation and call adds
    the most that the unaligned runs of b's octave (2**k < b < 2**(k + 1)) showed beyond that line, or those of the
    nearest octave below (else above) that has any: an envelope over every alignment seen. Run at one past a power
    of two, the batch that pads most for every tile size up to that power, each run bounds its octave.

    # NOTE: piecewise rather than one line: oneDNN rounds its buffers (the LSTM workspace is 28 KiB
    # per example at batches 2-4 and 24 KiB from 16 on), so a line through two small batches
    # over-predicts large ones by 12%; a line through the two largest sizes extrapolates. Scratch can step:
    # oneDNN's bf16 matrix multiply takes none at batches 1-2, 17,536 bytes at 3-32 and 25,728 from 40 on,
    # so a line from 2 to 4 missed batch 3 by -22% of the step's model and a line from 32 to 64 missed 48.
    # NOTE: the envelope, because scratch can depend on how the batch aligns with a kernel's tiles: oneDNN's bf16
    # matrix multiply on AMX (Intel Sapphire Rapids, issue 48) took about 8 KB more at odd batches below 32 and
    # 18 KB more at every batch from 33 to 63 than at 32 or 64, so a plan fitted at powers of two alone was 15-40%
    # under at odd batches and `max_batch_size` overran its budget by up to 37%. On AMD Zen 4 the same kernel pads
    # batches above 32 to a multiple of 32 rows (258 bytes a missing row: +8 KB at 33, +4 KB at 49, 0 at 64), so a
    # line through the unaligned runs (17, 49) was -6% at 33: the excess is bounded per octave, not interpolated.
    # Which other batches a kernel tiles whole is not known without running them: only powers of two take the line.
    """

    sizes: np.ndarray
    bytes_at: np.ndarray  # [len(sizes), planned allocations]: the calibrated allocation sizes
    scratch_at: np.ndarray  # [len(sizes), planned op calls]
    corrected: np.ndarray  # [planned allocations]: which ones the real runs made larger or smaller
    skipped: dict[int, str]  # calibration sizes whose real run failed, with the error
    # [len(sizes), planned allocations]: of each correction, what the same op's real tensor had beyond its planned
    # one (the kernel's own; the rest is the real runs' allocations the plan lacks or has alone, placed in order)
    resized: np.ndarray
    # the real runs follow the plan's line (`line_held`); False for a calibration carried over (`transfer`)
    line_held: bool = False

    def _at(self, values: np.ndarray, batch_size: int, *, steps: bool = False, envelope: bool = True) -> np.ndarray:
        aligned = is_aligned(self.sizes)
        if aligned.sum() < 2 or aligned.all():  # one kind of batch measured: one line through all
            return _piecewise(self.sizes, values, batch_size, steps)
        at, off = self.sizes[aligned], self.sizes[~aligned]
        line = _piecewise(at, values[aligned], batch_size, steps)
        if not envelope or is_aligned(batch_size):
            return line
        octaves, here = _octave(off), int(_octave(batch_size))
        below = octaves[octaves <= here]
        nearest = below.max() if len(below) else octaves.min()  # else the nearest octave above
        excess = [values[~aligned][k] - _piecewise(at, values[aligned], int(s), steps)
                  for k, s in enumerate(off) if octaves[k] == nearest]
        return line + np.maximum(0, np.max(excess, axis=0))

    def allocations(self, batch_size: int, *, envelope: bool = True) -> np.ndarray:
        """Bytes of each planned allocation at `batch_size` (`envelope=False`: on the aligned runs' line alone)."""
        return np.maximum(0, np.rint(self._at(self.bytes_at, batch_size, envelope=envelope))).astype(np.int64)

    def scratch(self, batch_size: int, *, envelope: bool = True) -> np.ndarray:
        """Scratch bytes of each planned op call at `batch_size` (`envelope=False`: the aligned runs' line alone)."""
        values = self._at(self.scratch_at, batch_size, steps=True, envelope=envelope)
        return np.maximum(0, np.rint(values)).astype(np.int64)


def _align(planned: Sequence[str], real: Sequence[str], *, window: int = 256, anchor: int = 4
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each real element the planned one it stands for (matched op names, else the last matched one
    before it, else the first planned), which planned elements the real run has and which real elements
    the plan has (matched).

    # NOTE: by hand, not difflib: both runs dispatch the same ops in the same order but for a few local
    # insertions (fake-only device queries, real-only copies), and difflib's matcher on long sequences of
    # recurring op names took minutes per run (a ResNet-50 step). Names only one run has are set aside;
    # equal names are matched in step; at a difference the two sequences resynchronise at the smallest total
    # skip (within `window` on each side) after which `anchor` names agree. Linear when differences are local.
    """
    both = set(planned) & set(real)  # names one run never dispatches (fake tensors' device queries) cannot match
    p_at = [i for i, name in enumerate(planned) if name in both]
    r_at = [j for j, name in enumerate(real) if name in both]
    p_names, r_names = [planned[i] for i in p_at], [real[j] for j in r_at]
    n, m = len(p_names), len(r_names)
    match = np.full(len(real), -1)
    found = np.zeros(len(planned), dtype=bool)
    a = b = 0
    while a < n and b < m:
        if p_names[a] == r_names[b]:
            match[r_at[b]], found[p_at[a]] = p_at[a], True
            a, b = a + 1, b + 1
            continue
        skip = _resync(p_names, r_names, a, b, window, anchor)
        if skip is None:  # nothing agrees nearby: the rest stays unmatched
            break
        a, b = a + skip[0], b + skip[1]
    matched = match >= 0
    last = 0
    for j in range(len(real)):
        last = match[j] = match[j] if matched[j] else last
    return match, found, matched


def _resync(planned: list[str], real: list[str], a: int, b: int, window: int, anchor: int
            ) -> tuple[int, int] | None:
    """The skips (i, j), smallest i + j first, after which planned[a + i:] and real[b + j:] agree on `anchor`
    names (or on all that is left of either)."""
    n, m = len(planned), len(real)
    for total in range(1, 2 * window + 1):
        for i in range(max(0, total - window), min(total, window) + 1):
            j = total - i
            if a + i >= n or b + j >= m or planned[a + i] != real[b + j]:
                continue
            k = min(anchor, n - a - i, m - b - j)
            if planned[a + i:a + i + k] == real[b + j:b + j + k]:
                return i, j
    return None


def observe(program: Callable[[int, _Tracker], None], size: int, device: torch.device) -> _Observed | str:
    """One real run of the training program at batch `size` under `device`'s allocator events, or the
    error with which the real step refused it (e.g. BatchNorm1d refuses a batch of one)."""
    try:
        return _observe(lambda tracker: program(size, tracker), device)
    except _TraceError as error:
        return str(error)


def warm_up(program: Callable[[int, _Tracker], None], size: int, device: torch.device) -> None:
    """On CUDA, one real step before calibration's: cuBLAS's and cuDNN's per-process handles and workspaces come
    with the first step and live on, and AllocatorMeter's peak (relative to entry) never sees them after it, so
    the smallest batch's run must not be charged with them. Nothing elsewhere."""
    if device.type == "cuda":
        observe(program, size, device)


def calibrate(planned: _Trace, plan_sizes: Callable[[int], np.ndarray], observed: dict[int, _Observed | str], *,
              least: int = 2) -> Calibration:
    """The calibrated plan from the plan (`planned`: its trace, `plan_sizes`: its own allocation sizes at a
    batch size, uncorrected) and real runs `observed` at >= `least` distinct small batch sizes (see
    `observe`; one size calibrates a plan of that size alone).

    # NOTE: fake tensors dispatch ops a real run does not (device queries, copies of fake constants),
    # so the steps' op calls and allocations are aligned by op name (`_align`). A planned allocation the
    # real run lacks is removed (delta -size); a real allocation the plan lacks is added to the planned
    # allocation before it; a real call's scratch goes to the planned call it matches (or follows).
    """
    if len(observed) < least or min(observed, default=1) < 1:
        raise ValueError(f"calibration needs >= {least} distinct batch sizes >= 1, got {tuple(sorted(observed))}")
    allocations, deltas, scratches, used, skipped, resized, founds, sequences = [], [], [], [], {}, [], [], set()
    p_alloc, p_call, p_ops, p_allocs = _steps(planned)
    for size in sorted(observed):
        real = observed[size]
        if isinstance(real, str):
            skipped[size] = real
            continue
        r_alloc, r_call, r_ops, r_allocs = _steps(real.trace)
        if not r_ops:
            raise ValueError(f"cannot calibrate at batch {size}: the real run dispatched no op in its steps")
        delta = np.zeros(len(planned.sizes), dtype=np.int64)
        match, found, matched = _align(p_allocs, r_allocs)
        real_sizes, plan_at = real.trace.sizes[r_alloc:], plan_sizes(size)[p_alloc:]
        delta[p_alloc:][~found] = -plan_at[~found]
        for j, i in enumerate(match):  # a real allocation the plan lacks adds to the planned one before it
            delta[p_alloc + i] += real_sizes[j] - (plan_at[i] if matched[j] else 0)
        resize = np.zeros(len(planned.sizes), dtype=np.int64)
        resize[p_alloc + match[matched]] = real_sizes[matched] - plan_at[match[matched]]
        founds.append(found)
        sequences.add(r_allocs)
        scratch = np.zeros(len(planned.calls), dtype=np.int64)
        match, _, _ = _align(p_ops, r_ops)
        np.maximum.at(scratch, p_call + match, real.scratch[r_call:])
        allocations.append(np.maximum(0, plan_sizes(size) + delta))
        deltas.append(delta)
        resized.append(resize)
        scratches.append(scratch)
        used.append(size)
    if len(used) < least:
        raise ValueError(f"calibration needs real runs at >= {least} batch sizes; failed at {skipped}")
    resized = np.stack(resized)
    held = _line_held(planned, p_alloc, plan_sizes, used, resized, np.stack(founds), len(sequences) == 1)
    return Calibration(np.asarray(used), np.stack(allocations), np.stack(scratches),
                       np.any(np.stack(deltas) != 0, axis=0), skipped, resized, held)


def _line_held(planned: _Trace, first_alloc: int, plan_sizes: Callable[[int], np.ndarray], used: Sequence[int],
               resized: np.ndarray, found: np.ndarray, one_sequence: bool) -> bool:
    """Whether the real runs at `used` show the plan's allocations on its line, as a fake trace at another batch
    checks them (`derive.fit`): every run made the same allocations in the same order; each allocation whose size
    moves with the batch, the batch's own tensors aside, was found in every run; each allocation a run matched
    exceeded the line by the same bytes in every run (0 where the kernel's tensor is its fake one's size); and
    none of the build's allocations (before `first_alloc`, not calibrated) moves with the batch. `found`: [runs, the
    steps' planned allocations], which each run had.

    # NOTE: then the check trace is redundant (issue 45): a fake size off its line at a batch the real runs took
    # would have its real tensor off it too, by what no kernel excess that is the same at every batch explains.
    """
    if len(used) < 2:
        return False
    moves = plan_sizes(used[0]) != plan_sizes(used[0] + 1)
    batch = np.asarray([info.get("kind") == "input" for info in planned.info], dtype=bool)
    return bool(one_sequence and not moves[:first_alloc].any()
                and found[:, (moves & ~batch)[first_alloc:]].all()
                and (resized == resized[0]).all())


def transfer(calibration: Calibration, source: _Trace, target: _Trace, target_sizes: Callable[[int], np.ndarray]
             ) -> Calibration:
    """`calibration` (of the plan whose trace is `source`) carried over to another program's plan (`target`, its
    own sizes `target_sizes`) of the same layers, traced at the same batch size: each op call of `target` takes
    the scratch measured for the calls of `source` with the same op and argument shapes (the most of them; none
    where no call matches), each allocation the kernel's own size correction (`Calibration.resized`) of the
    allocations made at the same place (its call's key, its order among that call's allocations). Allocations
    only one run had are not carried over: they stand where the plan's own (the batch a real step takes from
    the user's rows, a fake step draws) stand in the program calibrated, not in another.

    # NOTE: a variant of a program (step in backward, checkpoints) runs the same kernels on the same shapes in
    # another order, and a checkpoint's recomputation runs the forward's kernels again inside backward. Its
    # peak is elsewhere than the plain program's, beside another kernel's scratch: oneDNN's convolution
    # backward at 2 threads takes 141 kB at the peak of a DenseNet-BC-40's (growth 2, batch 4) step with block
    # checkpoints, which a correction measured at the plain program's peak (6.8 kB) left out: -15%.
    """
    if not source.keys or not target.keys:
        raise ValueError("carrying a calibration over needs both plans' call keys (traces under fake tensors)")
    columns: dict[tuple, list[int]] = {}
    for i, key in enumerate(source.keys):
        columns.setdefault(key, []).append(i)
    scratch = np.zeros((len(calibration.sizes), len(target.calls)), dtype=calibration.scratch_at.dtype)
    most = {key: calibration.scratch_at[:, at].max(axis=1) for key, at in columns.items()}
    for j, key in enumerate(target.keys):
        if key in most:
            scratch[:, j] = most[key]
    corrections: dict[tuple, np.ndarray] = {}
    for i, place in enumerate(_places(source)):
        if calibration.resized[:, i].any():
            corrections[place] = np.maximum(corrections.get(place, calibration.resized[:, i]),
                                            calibration.resized[:, i])
    delta = np.zeros((len(calibration.sizes), len(target.sizes)), dtype=np.int64)
    for j, place in enumerate(_places(target)):
        if place in corrections:
            delta[:, j] = corrections[place]
    planned = np.stack([target_sizes(int(s)) for s in calibration.sizes])
    return Calibration(calibration.sizes, np.maximum(0, planned + delta), scratch, np.any(delta != 0, axis=0),
                       dict(calibration.skipped), delta)


def _places(trace: _Trace) -> list[tuple]:
    """Each allocation's place: the key of the call that made it and its order among that call's allocations."""
    places, seen = [], {}
    for info in trace.info:
        call = info["call"]
        seen[call] = seen.get(call, -1) + 1
        places.append((trace.keys[call] if call < len(trace.keys) else None, seen[call]))
    return places
