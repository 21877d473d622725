"""torch.profiler without kineto's trace markers on stderr, for every profiler the workbench starts.

kineto writes `USDT:<date> <time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start` (and
`profiler_stop`) from C++ straight to fd 2 at every profiler start and stop, whatever KINETO_LOG_LEVEL says
short of silencing kineto's errors too (the level that hides them hides ERROR lines; it is also read once, at
init). In Jupyter, ipykernel forwards fd 2 to the notebook as a red stderr block, under papermill into the
report: hundreds of lines for a notebook that measures allocator events per layer.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Collection, Iterator, Sequence

import torch
from torch._C._profiler import RecordScope

__all__ = ["quiet_profile", "without_kineto_markers"]

_KINETO_MARKER = re.compile(rb"^USDT:\S+ \S+ \d+:\d+ \S+\.cpp:\d+\] .*$\n?", re.MULTILINE)
# c10's CPU allocator, at the first of every 1000 frees of a block allocated before the profiler started (Python's
# garbage of earlier code, collected inside): `measure.allocator_trace` leaves those frees out by design
_UNSEEN_FREE = re.compile(rb"^\[W\S+ \S+ CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated "
                          rb"before the profiling started.*$\n?", re.MULTILINE)


@contextlib.contextmanager
def without_kineto_markers() -> Iterator[None]:
    """Hold what is written to fd 2 inside the block and write it back without kineto's trace markers (and
    without c10's warning about frees of blocks allocated before a memory profiler started).

    # NOTE: the markers come from C++ (std::cerr), below sys.stderr, so only a redirect of the file
    # descriptor catches them. Only a profiler's start and stop run inside (milliseconds), and every other
    # line written meanwhile (a warning, another thread's error) is written back right after.
    """
    with tempfile.TemporaryFile() as held:
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            rest = _UNSEEN_FREE.sub(b"", _KINETO_MARKER.sub(b"", held.read()))
            if rest:
                os.write(2, rest)


@contextlib.contextmanager
def _recording_only(scopes: Collection[RecordScope] | None) -> Iterator[None]:
    """A profiler started inside the block records only the ranges of `scopes` (None: every scope).

    # NOTE: torch's C++ entry point `_enable_profiler` takes the scopes, `torch.profiler.profile` does not ask
    # for them: the block hands them to it. A torch whose entry point refuses them records every scope.
    """
    if scopes is None:
        yield
        return
    enable = torch.autograd.profiler._enable_profiler

    def only(config, activities):
        try:
            return enable(config, activities, set(scopes))
        except TypeError:
            return enable(config, activities)
    torch.autograd.profiler._enable_profiler = only
    try:
        yield
    finally:
        torch.autograd.profiler._enable_profiler = enable


@contextlib.contextmanager
def quiet_profile(user: str, activities: Sequence[torch.profiler.ProfilerActivity], *,
                  profile_memory: bool = False, scopes: Collection[RecordScope] | None = None
                  ) -> Iterator[torch.profiler.profile]:
    """`torch.profiler.profile(activities, profile_memory=...)` around the block, started and stopped without
    kineto's markers; read `.profiler.kineto_results` after the block. `scopes`: the ranges it records (None:
    all; `{RecordScope.USER_SCOPE}`: `record_function`'s, no op's). Only one profiler runs at a time: `user`
    names the caller in the error raised when one already runs."""
    if torch.autograd.profiler._is_profiler_enabled:
        raise RuntimeError(f"{user} needs torch.profiler, which is already running; stop it first")
    profiler = torch.profiler.profile(activities=list(activities), profile_memory=profile_memory)
    with without_kineto_markers(), _recording_only(scopes):
        profiler.__enter__()
    try:
        yield profiler
    finally:
        with without_kineto_markers():
            profiler.__exit__(None, None, None)
