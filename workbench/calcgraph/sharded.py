"""CalcGraph's plan for one rank of a model sharded by FSDP2, without the other ranks.

Extends Section 3.2 of "CalcGraph: taming the high costs of deep learning using models (2022)" (the
training step's memory compiled before it runs) to ``torch.distributed.fsdp.fully_shard``: the
training program is traced under fake tensors inside a fake process group of ``world_size`` ranks
(``torch.testing._internal.distributed.fake_pg``: collectives return at once, so one process plays
rank ``rank``), and what that rank allocates is its plan: its shards of the parameters, gradients
and optimizer state, the all-gathered parameters and reduce-scatter buffers, and its activations.

Two things a plan of an unsharded model does not meet: a DTensor is a wrapper whose own storage
has the global size while its memory is its local shard, and FSDP2 frees and re-allocates the
unsharded parameters with ``UntypedStorage.resize_``, which no dispatch mode sees. The sharded
tracker counts local shards and follows those resizes.

Beside the plan: :func:`fsdp_tracker_peak` (torch's own ``FSDPMemTracker``, real tensors in the
fake group), :func:`measure_sharded_peak` (the c10 allocator over the same program with real
tensors, one rank in the fake group) and :func:`measure_ranks_peak` (the allocator in each rank of a
real gloo run, :func:`run_on_ranks`).

What they show (torch 2.13, CPU; ``tests/calcgraph/test_sharded.py``): the plan of tensors alone
agrees with ``FSDPMemTracker`` to a few scalars. Where a dimension does not divide by the world size,
FSDP2's reduce-scatter copy-in (``chunk_cat``) allocates a padded scratch of the group's unsharded
gradient inside the kernel, which neither sees; the calibrated plan (real steps of this one rank in
the fake group) adds it and meets the allocator. A real gloo rank adds communication scratch the
plan does not model: gloo has no reduce-scatter of its own, torch runs it as an all-reduce on a clone
of the input (``aten::clone`` inside ``c10d::_reduce_scatter_base_``), a group's padded unsharded
gradient, allocated in gloo's worker thread and held until the work object is released. How many
clones are live at the peak is a race between threads: 0 to 1.7 steps' worth above the plan over 45
two-rank runs of the test model here, so budget a real gloo run two steps' clones above the plan.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from ..measure import AllocatorMeter
from .plan import CompiledGraph
from .program import OptimizerSpec, training_program
from .tracker import CALL_PREFIX, _call_key, _Tracker

__all__ = ["fsdp_tracker_peak", "measure_ranks_peak", "measure_sharded_peak", "plan_sharded_training",
           "fake_group", "local_tensors", "run_on_ranks", "shard_model", "sharded_memory_check", "sharded_program"]


def shard_model(model: nn.Module, mesh: Any, *, reshard_after_forward: bool = True) -> nn.Module:
    """``fully_shard`` every child module that holds parameters, then the root: FSDP2's usual layout
    (one all-gather per child; the root keeps what its children leave)."""
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)


def _check_ranks(world_size: int, rank: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: allowed integers >= 1")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r}: allowed integers in [0, {world_size - 1}]")


@contextlib.contextmanager
def fake_group(world_size: int, rank: int = 0) -> Iterator[Any]:
    """A fake process group of ``world_size`` ranks in which this process is ``rank``; yields its 1-D
    CPU device mesh. Collectives return at once without moving data (shapes and memory are real)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    _check_ranks(world_size, rank)
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process; a sharded plan needs its own "
                           "fake one (plan before dist.init_process_group, or in another process)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        # NOTE: made outside any fake-tensor trace: DeviceMesh reads its rank map with .tolist()
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def local_tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The plain tensors in ``tree``, a DTensor replaced by its local shard (wrapper subclasses flattened)."""
    stack = [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
    while stack:
        t = stack.pop()
        if not isinstance(t, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(t):
            stack += [getattr(t, name) for name in t.__tensor_flatten__()[0]]
        elif t.device.type != "meta" and not t.is_sparse:
            yield t


class _ShardedTracker(_Tracker):
    """CalcGraph's tracker for DTensor programs: counts a DTensor's local shard, not its wrapper.

    # NOTE: a DTensor's own storage has the global size but holds nothing (its data is the local
    # tensor); the ops on local tensors run inside DTensor's dispatch, below this mode, so the
    # local storages are read from the DTensors an op returns. Temporaries inside one DTensor op are
    # not seen (an elementwise op has none). The bookkeeping is ``LiveStorageMode``'s.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage()._cdata for t in local_tensors((args, kwargs))}
        with (torch.profiler.record_function(f"{CALL_PREFIX}{len(self.calls)}") if self.profiled
              else contextlib.nullcontext()):
            out = func(*args, **kwargs)
        for t in local_tensors(out):
            storage = t.untyped_storage()
            key, nbytes = storage._cdata, storage.nbytes()
            old = self._nbytes.get(key)
            if old is None and key in inputs or old == nbytes:
                continue
            if old is None:
                self._follow(storage)
            self._nbytes[key] = nbytes
            self._allocated(key, nbytes, old, func.__name__)
        self.calls.append((func.__name__, len(self.events)))
        if self.fake:
            self.keys.append(_call_key(func, args))
        return out

    def tag(self, tensor: torch.Tensor, zone: str, kind: str, name: str) -> None:
        for t in local_tensors(tensor):
            super().tag(t, zone, kind, name)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """Follow ``UntypedStorage.resize_`` (FSDP2 frees and re-allocates unsharded parameters so)."""
        key, nbytes = storage._cdata, storage.nbytes()
        old = self._nbytes.get(key)
        if nbytes == 0:
            self._forget(key)
        elif old != nbytes:
            if key not in self._watched:
                self._follow(storage)
            self._nbytes[key] = nbytes
            self._allocated(key, nbytes, old, "resize_")


@contextlib.contextmanager
def _following_resizes(tracker: _ShardedTracker | None) -> Iterator[None]:
    # NOTE: torch's FSDPMemTracker patches the same method for the same reason: a storage resized in
    # place calls no aten op, so no dispatch mode sees it.
    original = torch.UntypedStorage.resize_

    def resize_(storage, size):
        out = original(storage, size)
        if tracker is not None:
            tracker.resized(storage)
        return out

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original


def sharded_program(model_fn: Callable[[], nn.Module], input_shape: Sequence[int], world_size: int, rank: int,
                    kwargs: dict[str, Any], size: int, tracker: _Tracker | None) -> None:
    """``training_program`` of rank ``rank`` of ``world_size`` in a fake group (``kwargs``: its options: the
    optimizer, autocast, step in backward, the batch); ``tracker`` (a plan, or a calibration run) is made to
    see DTensors' local shards and FSDP2's storage resizes. ``functools.partial`` of the first five arguments
    is a program `CompiledGraph` plans (as `plan_sharded_training` does, and the memory advisor)."""
    if tracker is not None:
        # NOTE: CompiledGraph and its calibration create a plain tracker; its class is switched to the
        # sharded one (same state, two methods more) for the DTensor program.
        tracker.__class__ = _ShardedTracker
    with fake_group(world_size, rank) as mesh, _following_resizes(tracker):
        training_program(lambda: shard_model(model_fn(), mesh), input_shape, size, annotate=tracker, **kwargs)


def plan_sharded_training(
    model_fn: Callable[[], nn.Module], sample_input: torch.Tensor | Sequence[int], world_size: int, *,
    rank: int = 0, optimizer: OptimizerSpec = "adamw", lr: float = 1e-3, loss: Callable | None = None,
    input_dtype: torch.dtype | None = None, trace_sizes: Sequence[int] = (2, 3, 4), calibrate: bool | None = None,
) -> CompiledGraph:
    """CalcGraph's plan of rank ``rank`` training ``model_fn()`` sharded by FSDP2 over ``world_size`` ranks.

    ``model_fn`` builds the unsharded model (each child with parameters and the root are then
    ``fully_shard``ed: :func:`shard_model`); ``sample_input`` and the other options as in
    ``plan_training``, with the batch size the per-rank (local) batch. No other rank runs: the
    program is traced in a fake process group (:func:`fake_group`; calibration, on by default on CPU,
    runs real steps of this one rank in it). ``required_bytes(b)`` is the rank's predicted peak.
    """
    if input_dtype is None:
        input_dtype = sample_input.dtype if isinstance(sample_input, torch.Tensor) else torch.float32
    shape = tuple(sample_input.shape[1:]) if isinstance(sample_input, torch.Tensor) else tuple(sample_input)
    _check_ranks(world_size, rank)
    kwargs = dict(optimizer=optimizer, lr=lr, loss=loss, input_dtype=input_dtype, device=torch.device("cpu"))
    program = functools.partial(sharded_program, model_fn, shape, world_size, rank, kwargs)
    graph = CompiledGraph(program, device=torch.device("cpu"), trace_sizes=trace_sizes, input_shape=shape,
                          description=f"input {shape} {input_dtype}, FSDP2 rank {rank} of {world_size}")
    graph.input_shape, graph.input_dtype, graph.world_size, graph.rank = shape, input_dtype, world_size, rank
    return graph.calibrate() if calibrate or calibrate is None else graph


def _step_kwargs(optimizer: OptimizerSpec, lr: float, input_dtype: torch.dtype) -> dict[str, Any]:
    return dict(optimizer=optimizer, lr=lr, input_dtype=input_dtype, device=torch.device("cpu"))


def measure_sharded_peak(model_fn: Callable[[], nn.Module], input_shape: Sequence[int], world_size: int,
                         batch_size: int, *, rank: int = 0, optimizer: OptimizerSpec = "adamw", lr: float = 1e-3,
                         input_dtype: torch.dtype = torch.float32) -> int:
    """The c10 allocator's peak over the real program of rank ``rank`` in a fake group (``AllocatorMeter``)."""
    with fake_group(world_size, rank) as mesh, AllocatorMeter("cpu") as meter:
        training_program(lambda: shard_model(model_fn(), mesh), tuple(input_shape), batch_size,
                         **_step_kwargs(optimizer, lr, input_dtype))
    return meter.peak_bytes


def fsdp_tracker_peak(model_fn: Callable[[], nn.Module], input_shape: Sequence[int], world_size: int,
                      batch_size: int, *, rank: int = 0, optimizer: OptimizerSpec = "adamw", lr: float = 1e-3,
                      input_dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """torch's ``FSDPMemTracker`` over two real steps of rank ``rank`` in a fake group: peak bytes by its
    categories, and ``Total``. # NOTE: it tracks from its entry (the model and optimizer are built before,
    as its documentation shows); the state created in the first step counts."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from .program import make_optimizer

    with fake_group(world_size, rank) as mesh:
        model = shard_model(model_fn(), mesh)
        opt = make_optimizer(optimizer, model.parameters(), lr=lr)
        tracker = FSDPMemTracker(model, opt)
        with tracker:
            for _ in range(2):
                x = torch.randn(batch_size, *input_shape, dtype=input_dtype)
                tracker.track_inputs((x,))
                nn.functional.cross_entropy(model(x), torch.zeros(batch_size, dtype=torch.long)).backward()
                opt.step()
                opt.zero_grad()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return {str(getattr(k, "value", k)): int(v) for k, v in peak.items()}


def _rank_peak(rank: int, world_size: int, model_fn: Callable[[], nn.Module], input_shape: Sequence[int],
               batch_size: int, kwargs: dict[str, Any]) -> int:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    with AllocatorMeter("cpu") as meter:
        training_program(lambda: shard_model(model_fn(), mesh), tuple(input_shape), batch_size, **kwargs)
    return meter.peak_bytes


def measure_ranks_peak(model_fn: Callable[[], nn.Module], input_shape: Sequence[int], world_size: int,
                       batch_size: int, *, optimizer: OptimizerSpec = "adamw", lr: float = 1e-3,
                       input_dtype: torch.dtype = torch.float32, timeout: float = 180.0) -> list[int]:
    """Each rank's allocator peak in a real gloo run of ``world_size`` processes (:func:`run_on_ranks`);
    ``model_fn`` and ``optimizer`` must pickle (module-level callables, ``functools.partial``)."""
    return run_on_ranks(_rank_peak, world_size, model_fn, tuple(input_shape), batch_size,
                        _step_kwargs(optimizer, lr, input_dtype), timeout=timeout)


def sharded_memory_check(model_fn: Callable[[], nn.Module], input_shape: Sequence[int], world_size: int,
                         batch_size: int, *, optimizer: OptimizerSpec = "adamw", lr: float = 1e-3,
                         input_dtype: torch.dtype = torch.float32, real_ranks: bool = True) -> pd.DataFrame:
    """Rank 0's peak four ways: CalcGraph's plan (uncalibrated: tensors only; calibrated), torch's
    FSDPMemTracker, the allocator in the fake group and, with ``real_ranks``, in each rank of a gloo run."""
    common = dict(optimizer=optimizer, lr=lr, input_dtype=input_dtype)
    plan = plan_sharded_training(model_fn, tuple(input_shape), world_size, calibrate=False, **common)
    rows = [("CalcGraph plan (tensors)", plan.required_bytes(batch_size))]
    plan.calibrate()
    rows.append(("CalcGraph plan (calibrated)", plan.required_bytes(batch_size)))
    rows.append(("FSDPMemTracker", fsdp_tracker_peak(model_fn, input_shape, world_size, batch_size, **common)["Total"]))
    rows.append(("allocator, fake group", measure_sharded_peak(model_fn, input_shape, world_size, batch_size,
                                                               **common)))
    if real_ranks:
        peaks = measure_ranks_peak(model_fn, input_shape, world_size, batch_size, **common)
        rows += [(f"allocator, gloo rank {r}", p) for r, p in enumerate(peaks)]
    return pd.DataFrame([{"world_size": world_size, "batch_size": batch_size, "measure": m, "peak_bytes": int(b)}
                         for m, b in rows])


def _rank_main(rank: int, fn: Callable, world_size: int, store_path: str, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)  # ranks share the machine's cores
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                                world_size=world_size)
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
        open(os.path.join(out_dir, f"rank{rank}.done"), "w").close()  # every rank's result is saved
    except BaseException:
        # NOTE: when one rank fails, the others fail next in their collectives ("connection closed by
        # peer"); torch's join reports whichever it sees first, so each rank leaves its error and the time,
        # before its group is destroyed (which is what the others see).
        path = os.path.join(out_dir, f"rank{rank}.err")
        with open(path + ".part", "w") as out:  # whole or absent where the parent reads it
            out.write(f"{time.time()!r}\n{traceback.format_exc()}")
        os.replace(path + ".part", path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _first_error(tmp: str, world_size: int) -> tuple[int, str] | None:
    errors = []
    for rank in range(world_size):
        path = os.path.join(tmp, f"rank{rank}.err")
        if os.path.exists(path):
            with open(path) as f:
                when, _, text = f.read().partition("\n")
            errors.append((float(when), rank, text))
    return min(errors)[1:] if errors else None


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes joined by a gloo process group
    (CPU); return each rank's result (saved with ``torch.save``), in rank order.

    ``fn`` and ``args`` must pickle (a module-level function). The group meets through a file store
    in a fresh temporary folder, so no port has to be agreed on beforehand (gloo's own connections
    take free ports from the system). Every process is joined: on an error in any rank, or after
    ``timeout`` seconds, the others are terminated and a RuntimeError carrying the traceback of the
    rank that failed first (or a TimeoutError) is raised here.
    """
    _check_ranks(world_size, 0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout={timeout!r}: allowed numbers of seconds > 0")
    with tempfile.TemporaryDirectory(prefix="workbench-ranks-") as tmp:
        ctx = mp.start_processes(_rank_main, args=(fn, world_size, os.path.join(tmp, "store"), tmp, args),
                                 nprocs=world_size, join=False, start_method="spawn")
        try:
            deadline = time.monotonic() + timeout
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} ranks running {getattr(fn, '__name__', fn)} did not finish "
                                       f"within {timeout} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
            if _all_done(tmp, world_size):
                # NOTE: a rank that died after every rank saved its result and passed the last barrier died in
                # teardown (gloo's or the interpreter's: "terminate called without an active exception", SIGABRT,
                # once in seven CI runs of tests/optim/test_distributed.py), not in `fn`: the results stand
                warnings.warn(f"{error} after every rank of {getattr(fn, '__name__', fn)} finished; its results are "
                              f"kept", RuntimeWarning, stacklevel=2)
                return _results(tmp, world_size)
            name = getattr(fn, "__name__", fn)
            # NOTE: a rank that died without a Python error (a signal, `os._exit`) left no error file, and the others
            # then fail in their collectives: that rank is the cause, whichever error torch's join saw first (join
            # stops the other ranks with SIGTERM: not a cause)
            raised = error.error_index if isinstance(error, mp.ProcessRaisedException) else None
            died = [(rank, p.exitcode) for rank, p in enumerate(ctx.processes)
                    if p.exitcode and p.exitcode != -signal.SIGTERM and rank != raised
                    and not os.path.exists(os.path.join(tmp, f"rank{rank}.err"))]
            first = _first_error(tmp, world_size)
            if died:
                rank, code = died[0]
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                after = f"; the first error after it, rank {first[0]}'s:\n{first[1]}" if first else ""
                raise RuntimeError(f"rank {rank} of {world_size} died ({how}) running {name} without a Python "
                                   f"error{after}") from error
            if first is None:
                raise
            raise RuntimeError(f"rank {first[0]} of {world_size} failed first running {name}:\n{first[1]}") from error
        finally:
            for process in ctx.processes:
                if process.is_alive():
                    process.terminate()
                process.join()
        return _results(tmp, world_size)


def _all_done(tmp: str, world_size: int) -> bool:
    return all(os.path.exists(os.path.join(tmp, f"rank{rank}.done")) for rank in range(world_size))


def _results(tmp: str, world_size: int) -> list[Any]:
    return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
