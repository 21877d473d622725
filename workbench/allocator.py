"""The allocator's own count of memory (DESIGN.md, "Measuring honestly"): `AllocatorMeter`, the independent
measure beside `workbench.measure.MemoryMeter`'s count of tensors. On CPU the c10 allocator's events as
torch.profiler records them (kernel-internal scratch included), on CUDA the caching allocator's statistics.
Re-exported by `workbench.measure`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._C._profiler import RecordScope, _EventType

from .kineto import quiet_profile, without_kineto_markers
from .measure_args import _device

__all__ = ["AllocatorMeter", "allocator_events", "allocator_trace"]


@contextlib.contextmanager
def allocator_events(user: str = "allocator_events", device: torch.device | str = "cpu"
                     ) -> Iterator[torch.profiler.profile]:
    """torch.profiler recording the allocators' events (`profile_memory=True`: the CPU allocator's, and on a
    CUDA `device` the caching allocator's too, each event with its device) and the ranges of the caller's
    `torch.profiler.record_function` around the block, without the trace markers kineto prints at each start and
    stop; read `.profiler.kineto_results` after the block. Only one profiler runs at a time: `user` names the
    caller in the error raised when one already runs."""
    # NOTE: fd 2 held for the whole block, not only the profiler's start and stop: c10 warns there when a block
    # allocated before entry is freed inside (garbage collected meanwhile), a free `allocator_trace` leaves out.
    # CUDA's activity is asked for on a CUDA device, as torch's own memory timeline does for its device events.
    activities = [torch.profiler.ProfilerActivity.CPU]
    cuda = torch.device(device).type == "cuda"
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    # NOTE: on the CPU no op's range (`RecordScope.USER_SCOPE` only): every reader takes the allocator's events and
    # its own marks, and recording each op besides took half of a profiled training step's start-to-stop and of its
    # reading. On CUDA every scope, as before, until a GPU run shows the caching allocator's events without them
    # (`test_the_cuda_allocator_trace_is_what_max_memory_allocated_counts`)
    scopes = None if cuda else {RecordScope.USER_SCOPE}
    with without_kineto_markers(), quiet_profile(user, activities, profile_memory=True, scopes=scopes) as profiler:
        yield profiler


def allocator_trace(profiler: torch.profiler.profile, device: torch.device | str = "cpu") -> list[tuple[int, int]]:
    """`device`'s allocator events an `allocator_events` block recorded, in time order: (ns, +bytes) per
    allocation and (ns, -bytes) per free of a block allocated inside the block; frees of older blocks left out.
    On CUDA these are the caching allocator's blocks handed out and given back (what `max_memory_allocated`
    counts), recorded on the host as each call makes them.

    # NOTE: matched by address (the profiler's event tree has it; its flat event list does not): c10's CPU
    # reporter sizes a free from a table it fills only while a profiler runs, so a block allocated under an
    # earlier profiler and freed outside any leaves its size behind, and a later block at the same address,
    # allocated before entry and freed inside, was counted with that stale size (a 3 MB free read as -10 MB).
    """
    device = torch.device(device)  # "cuda" without an index: every GPU's events (a program runs on one)
    found, stack = [], list(profiler.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == device.type and (
                device.index is None or event.extra_fields.device.index == device.index):
            found.append((event.start_time_ns, event.extra_fields.ptr, event.extra_fields.alloc_size))
    live: set[int] = set()
    trace = []
    for ns, ptr, nbytes in sorted(found, key=lambda e: e[0]):
        if nbytes >= 0:
            live.add(ptr)
        elif ptr in live:
            live.discard(ptr)
        else:
            continue
        trace.append((ns, nbytes))
    return trace


class AllocatorMeter:
    """Peak bytes the device's allocator handed out inside a `with` block, net of frees inside it.

    The independent measure for everything counted from tensors (MemoryMeter's CPU tracker, CalcGraph's
    fake-tensor plan): it shares no counting rule with them. On CPU, every allocation and free of the
    c10 CPU allocator while the block runs (torch.profiler with `profile_memory=True`), summed in time
    order (`allocator_trace`); frees of blocks allocated before entry are not counted, so the figure is
    relative to entry like MemoryMeter's. Kernel scratch (BatchNorm, oneDNN RNN
    workspaces) counts. On CUDA, `max_memory_allocated` relative to entry, and `reserved_peak_bytes`,
    the caching allocator's absolute `max_memory_reserved` (what actually runs out).

    # NOTE: the profiler's events are read directly (kineto results) rather than exported to a chrome
    # trace, which writes a file per measurement; only one profiler can run at a time.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = _device(device, "AllocatorMeter")
        self.peak_bytes = 0
        self.end_bytes = 0
        self.reserved_peak_bytes: int | None = None
        self._stack = contextlib.ExitStack()
        self._profiler: torch.profiler.profile | None = None
        self._cuda_start = 0

    def __enter__(self) -> AllocatorMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_start = torch.cuda.memory_allocated(self.device)
            return self
        self._profiler = self._stack.enter_context(allocator_events("AllocatorMeter"))
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._cuda_start
            self.end_bytes = torch.cuda.memory_allocated(self.device) - self._cuda_start
            self.reserved_peak_bytes = torch.cuda.max_memory_reserved(self.device)
            return
        profiler, self._profiler = self._profiler, None
        self._stack.close()
        current = peak = 0
        for _, nbytes in allocator_trace(profiler):
            current += nbytes
            peak = max(peak, current)
        self.peak_bytes, self.end_bytes = peak, current
