"""Independent traces run in forked worker processes, one per core (issue 45).

A trace runs a training program under fake tensors: Python dispatch on one core, while the machine's other cores
idle. A planner that needs several traces (the advisor: each distinct program at its batches; a plan: its fit's
batches) hands them to `run_forked`, which runs them side by side and returns each result, or None for one the
caller must run itself (no fork here, a CUDA context, a job that failed, workers that stopped progressing).

# NOTE: hand-written over `multiprocessing`'s fork pool, not `concurrent.futures`: a training program is a
# closure over the user's model builder, which does not pickle. The jobs are left where the fork copies them
# (module state) and only their index and pickled result cross the pipe, the way torch's DataLoader forks its
# workers over a dataset that need not pickle.
"""

from __future__ import annotations

import functools
import gc
import multiprocessing
import os
import pickle
import signal
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .kernels import mark_sent, merge_received, new_entries, receive
from .tracker import _trace, collector_paused

__all__ = ["ENV", "run_forked", "worker_count"]

ENV = "WORKBENCH_TRACE_PROCESSES"  # worker processes for traces; 1 traces in the calling process only
STALL_SECONDS = 120.0  # workers that use no CPU for this long while jobs are left are stopped (a fork deadlock)
_POLL_SECONDS = 5.0
_JOBS: Sequence[Callable[[], Any]] = ()


def worker_count() -> int:
    """Processes `run_forked` may use: $WORKBENCH_TRACE_PROCESSES, else the cores this process may run on."""
    value = os.environ.get(ENV, "").strip()
    if value:
        if not value.isascii() or not value.isdigit() or int(value) < 1:
            raise ValueError(f"{ENV}={value!r}: give a whole number of processes >= 1 (1 traces in this process)")
        return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _start_worker() -> None:
    torch.set_num_threads(1)  # a trace is one core's Python; a forked libgomp pool must not be entered
    # NOTE: Python's cyclic collector off, and what the fork copied out of its reach: a trace collects at its marks
    # itself (`tracker._trace`), and each automatic full collection after one walked the parent's whole heap (a
    # notebook's: 0.1-0.2 s, and it touches every copied page); a worker lives for a few traces, with fake tensors
    gc.disable()
    gc.freeze()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupt is the parent's: it stops the pool
    mark_sent()


def _run(index: int) -> tuple[int, bytes | None, bytes]:
    """The job's result pickled (None where it failed: the caller runs it again itself, and meets the error with its
    own context) and the dispatch cache entries it made (`kernels.new_entries`)."""
    try:
        result = pickle.dumps(_JOBS[index]())
    except Exception:  # noqa: BLE001 - see the docstring
        result = None
    return index, result, new_entries()


def _cpu_seconds(processes: list) -> float:
    import psutil  # comes with ipykernel

    total = 0.0
    for process in processes:
        try:
            times = psutil.Process(process.pid).cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def run_forked(jobs: Sequence[Callable[[], Any]], processes: int | None = None) -> list[Any]:
    """Each job's result, the jobs run in up to `processes` (default `worker_count()`) forked workers; None where
    the caller must run a job itself. Results must pickle."""
    global _JOBS
    results: list[Any] = [None] * len(jobs)
    with collector_paused():  # what earlier workers sent back, for these to inherit
        merge_received()
    workers = min(len(jobs), worker_count() if processes is None else processes)
    if workers < 2 or "fork" not in multiprocessing.get_all_start_methods() or torch.cuda.is_initialized():
        return results  # a CUDA context does not survive a fork
    _JOBS = jobs
    try:
        with warnings.catch_warnings():
            # Python >= 3.12 warns on any fork of a process with threads (a Jupyter kernel's): the workers start from
            # `_start_worker` and run only fake-tensor Python, and a stalled one is stopped below
            warnings.filterwarnings("ignore", message=r".*fork\(\) may lead to deadlocks", category=DeprecationWarning)
            pool = multiprocessing.get_context("fork").Pool(workers, initializer=_start_worker)
        with pool:
            pending = pool.imap_unordered(_run, range(len(jobs)))
            used, still = _cpu_seconds(multiprocessing.active_children()), 0.0
            for _ in range(len(jobs)):
                while True:
                    try:
                        index, value, entries = pending.next(timeout=_POLL_SECONDS)
                        receive(entries)
                        break
                    except multiprocessing.TimeoutError:
                        now = _cpu_seconds(multiprocessing.active_children())
                        still = still + _POLL_SECONDS if now <= used + 0.01 else 0.0
                        used = now
                        if still >= STALL_SECONDS:
                            return results
                results[index] = None if value is None else pickle.loads(value)
    finally:
        _JOBS = ()
    return results


FORK_AFTER_SECONDS = 0.5  # a trace shorter than this is not worth a worker (its start and its result's pickle)


def trace_program(program: Callable, size: int, device: torch.device) -> Any:
    """`program` (a CalcGraph training program) traced under fake tensors at batch `size`."""
    return _trace(lambda tracker: program(size, tracker), device=device)


def trace_ahead(graph, sizes: Sequence[int]) -> None:
    """Trace `graph`'s program at each of `sizes` it has not traced: the first here, the rest side by side in forked
    workers where that first trace took long enough to pay for them (`graph._traced` traces what a worker did not)."""
    missing = [s for s in sizes if s not in graph._exact]
    if len(missing) < 2:
        return
    start = time.perf_counter()
    graph._traced(missing[0])
    if time.perf_counter() - start < FORK_AFTER_SECONDS:
        return
    jobs = [functools.partial(traced_at, graph._tracer, s) for s in missing[1:]]
    for size, made in zip(missing[1:], run_forked(jobs), strict=True):
        keep_traced(graph, size, made)


def traced_at(tracer: Callable, size: int) -> tuple | None:
    """`tracer` (`derive.StepTracer`) at batch `size`, and the one-step trace it made that from (None where it traced
    both steps), for the process that forked the one running it: a checkpoint placement is composed from one-step
    traces (the advisor's `Plans`). None where it failed (traced again where asked for, to meet the error there)."""
    try:
        return tracer(size), tracer.first_steps.get(size)
    except Exception:  # noqa: BLE001 - see the docstring
        return None


def keep_traced(graph, size: int, made: tuple | None) -> None:
    """Keep in `graph` (a `CompiledGraph`) what `traced_at` made at batch `size` in another process."""
    if made is not None:
        graph._exact.setdefault(size, made[0])
        if made[1] is not None:
            graph._tracer.first_steps.setdefault(size, made[1])
