"""Measuring memory and time honestly (DESIGN.md, "Measuring honestly").

Memory is the peak of tensor bytes allocated inside a region and live at the same moment:
on CUDA from the caching allocator's statistics, on CPU from a dispatch-mode tracker of the
storages created in the region, which runs the program as it runs without one (`workbench.inplace`).
`AllocatorMeter` is the independent measure beside it: the allocator's own running total (on CPU the
c10 allocator's events, as torch.profiler records them), which also sees kernel-internal scratch that
never becomes a tensor. Process RSS is never used as a tensor-memory figure. Timing (`time_callable`,
`time_interleaved`, `calls_for`) lives in `workbench.timing` and `AllocatorMeter` in `workbench.allocator`, both
re-exported here.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable, Iterator

import numpy as np
import pandas as pd
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.fake_tensor import _device_handler as _fake_device
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from .inplace import InPlace, as_the_user_runs
from .allocator import AllocatorMeter, allocator_events, allocator_trace  # re-exported: the measures in one place
from .measure_args import _device, check_device, check_flag
from .timing import Timing, calls_for, time_callable, time_interleaved

__all__ = [
    "AllocatorMeter", "LiveStorageMode", "MemoryMeter", "Timing", "allocator_events", "allocator_trace", "calls_for",
    "check_device", "time_callable", "format_bytes",
    "measure_training_step", "plot_memory_trace", "state_bytes", "time_interleaved",
]


def format_bytes(n: float) -> str:
    """Human-readable binary size, e.g. 12.5 MiB."""
    if isinstance(n, bool) or not isinstance(n, (int, float, np.integer, np.floating)):
        raise TypeError(f"format_bytes needs a number of bytes, got {n!r} ({type(n).__name__})")
    if not math.isfinite(n):
        return f"{n} B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def op_tensors(tree) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs: a tensor, or tuples, lists and dicts of them (any depth).

    # NOTE: by hand rather than `torch.utils._pytree.tree_leaves`, which cost a sixth of a traced ResNet-50
    # step (called twice for every op of it); aten's arguments and results hold no other containers."""
    found, stack = [], [tree]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed(value))
        elif isinstance(value, dict):
            stack.extend(reversed(value.values()))
    return found


def _storages(tree, keep: Callable[[torch.Tensor], bool] = lambda tensor: True) -> list[torch.UntypedStorage]:
    return [t.untyped_storage() for t in op_tensors(tree)
            if t.device.type != "meta" and not t.is_sparse and keep(t)]


# NOTE: `torch.tensor(data)` builds its tensor without an op and then hands it to `lift_fresh` (under a dispatch
# mode): that storage is new although the op received it (AdamW's step counters, 4 bytes a parameter)
_LIFT_FRESH = torch.ops.aten.lift_fresh.default
# NOTE: a fake tensor's device is asked through the dispatcher (`prim.device`) each time C++ code reads it: in a
# traced ResNet-50 step 4,938 of 8,643 calls (57%), each one through this mode's Python. It creates no storage: it
# is neither counted nor recorded as a call, and a fake tensor's is answered here by torch's own handler (the fake
# mode's, without its dispatch under this mode: a DenseNet-BC-100 trace 6% shorter)
_PRIM_DEVICE = torch.ops.prim.device.default


class LiveStorageMode(TorchDispatchMode):
    """A dispatch mode that follows every storage aten ops create while it is active until it is freed.

    The counting rule of :class:`MemoryMeter` on CPU (and of CalcGraph's tracker and budget guard):
    a view, in-place or ``out=`` result on a storage an op received is not new memory; a storage
    resized in place counts again. The program counted is the user's: the adds that torch runs in
    place only where no dispatch mode is active (autograd's gradient sums, ``linear``'s bias) run in
    place here too (`workbench.inplace`). Subclasses get ``_allocated(key, nbytes, old_nbytes, op)``
    (``old_nbytes`` None for a new storage) and ``_released(key, nbytes)``, and may wrap ``_counted``,
    which runs an op and counts what it creates.

    # NOTE: written by hand rather than torch's MemTracker, which is private to
    # torch.distributed._tools and attributes memory to modules; here only live storages are
    # needed. A storage's Python object is preserved for its lifetime, so a weak reference's callback
    # on it fires exactly when the storage is freed (a plain `weakref.ref`, kept until then, not
    # `weakref.finalize`, whose registry of its own is more work on each of a trace's allocations).
    """

    def __init__(self) -> None:
        super().__init__()
        self._nbytes: dict[int, int] = {}
        self._watched: dict[int, weakref.ref] = {}  # each followed storage's reference, until it is freed
        self.in_place = InPlace()  # the user's in-place adds that a dispatch mode would run out of place
        self._following: list[contextlib.AbstractContextManager] = []  # one per entry

    def __enter__(self) -> LiveStorageMode:
        following = as_the_user_runs(self.in_place)
        following.__enter__()
        self._following.append(following)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._following.pop().__exit__(None, None, None)

    def _watching(self) -> bool:
        """False lets ops run unobserved while the mode stays on the stack (frees are still followed)."""
        return True

    def _counts(self, tensor: torch.Tensor) -> bool:
        """Whether the storage of `tensor` (an op's new output) is counted: every one here."""
        return True

    def _allocated(self, key: int, nbytes: int, old_nbytes: int | None, op: str) -> None:
        raise NotImplementedError

    def _released(self, key: int, nbytes: int) -> None:
        raise NotImplementedError

    def _forget(self, key: int) -> None:
        nbytes = self._nbytes.pop(key, None)
        if nbytes is not None:
            self._released(key, nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE:
            return _fake_device(args) if isinstance(args[0], FakeTensor) else func(*args)
        kwargs = kwargs or {}
        op = self.in_place.op_for(func, args, kwargs)
        out = self._counted(op, args, kwargs, op_tensors((args, kwargs)))
        self.in_place.done(op, out)
        return out

    def _counted(self, op, args, kwargs, tensors: list[torch.Tensor]):
        """Run `op` and count the storages it creates (`tensors`: those among its arguments)."""
        inputs = {t.untyped_storage()._cdata for t in tensors if t.device.type != "meta" and not t.is_sparse}
        out = op(*args, **kwargs)
        if self._watching():
            for storage in _storages(out, self._counts):
                key, nbytes = storage._cdata, storage.nbytes()
                old = self._nbytes.get(key)
                if old is None:
                    if key in inputs and op is not _LIFT_FRESH:
                        continue
                    self._follow(storage)
                elif old == nbytes:
                    continue
                self._nbytes[key] = nbytes
                self._allocated(key, nbytes, old, op.__name__)
        return out

    def _follow(self, storage: torch.UntypedStorage) -> None:
        """`_forget` `storage` when it is freed."""
        key = storage._cdata
        self._watched[key] = weakref.ref(storage, functools.partial(self._freed, key))

    def _freed(self, key: int, _ref: weakref.ref) -> None:
        self._watched.pop(key, None)
        self._forget(key)

    def close(self) -> None:
        """Stop following frees (once the observed job is over): the references go, their callbacks with them."""
        self._watched.clear()


class _StorageTracker(LiveStorageMode):
    """Live bytes (current and peak) of the storages created while active, optionally over time."""

    def __init__(self, *, trace: bool) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self.events: list[tuple[int, str, int]] | None = [] if trace else None

    def _record(self, op: str) -> None:
        if self.events is not None:
            self.events.append((len(self.events), op, self.current))

    def _allocated(self, key: int, nbytes: int, old_nbytes: int | None, op: str) -> None:
        self.current += nbytes - (old_nbytes or 0)
        self.peak = max(self.peak, self.current)
        self._record(op)

    def _released(self, key: int, nbytes: int) -> None:
        self.current -= nbytes
        self._record("free")


@contextlib.contextmanager
def cpu_rng_state_as_op(*, fake: bool = False) -> Iterator[None]:
    """`torch.get_rng_state()` as an op a dispatch mode sees: for real a dispatched copy of the state, under fake
    tensors (CalcGraph's plans) a stand-in of the real state's size (which `torch.set_rng_state` takes, changing
    nothing). So a plan counts the CPU generator states that activation checkpointing keeps per
    segment and `torch.random.fork_rng` holds while it recomputes, and calibration finds them in the real run too.

    # NOTE: the generator makes its state tensor without dispatching an op, so no trace saw it: 5,056 bytes per
    # checkpointed segment, 5-11% of a small MLP's peak under uniform checkpoints. Patched process-wide while a
    # program is traced (torch.utils.checkpoint looks both functions up at each call); not again inside one
    # patched the same way. Not under `MemoryMeter` (issue 43: `measure_required_bytes` misses these states):
    # the dispatched copy is an allocation the program without the meter does not make, which
    # tests/test_inplace_as_the_user_runs.py refuses, and the checkpoint planner does not count them yet.
    """
    if getattr(torch.get_rng_state, "_as_op", None) is fake:  # already, the same way
        yield
        return
    get, put = torch.get_rng_state, torch.set_rng_state
    size = get().numel()

    def tracked_get() -> torch.Tensor:
        # the same op in both runs, so that calibration matches the real state with the planned one
        state = torch.empty(size, dtype=torch.uint8)
        return state if fake else state.copy_(get())

    def tracked_put(state: torch.Tensor) -> None:
        if not fake:  # under fake tensors every state is a stand-in (a real one of integers, see calcgraph.values)
            put(state)

    tracked_get._as_op = fake
    torch.get_rng_state, torch.set_rng_state = tracked_get, tracked_put
    try:
        yield
    finally:
        torch.get_rng_state, torch.set_rng_state = get, put


class MemoryMeter:
    """Peak bytes of tensors allocated inside a `with` block and live at once.

    On CUDA: `max_memory_allocated` after `reset_peak_memory_stats`, relative to the bytes
    allocated at entry (allocator rounding included, frees of older tensors lower the count).
    On CPU: exact storage bytes of every tensor an aten op creates inside the block, in the program
    as it runs without the meter (`LiveStorageMode`); tensors created before entry are not counted.
    Kernel-internal scratch buffers that never become tensors are invisible on CPU. With
    `trace=True`, `.trace` is memory over time: a DataFrame with one row per allocation or free
    (columns event, op, bytes), on either device. With `allocator=True`, `.allocator_peak_bytes` is
    the same block's peak by `AllocatorMeter` (the independent count, scratch included) and, on
    CUDA, `.reserved_peak_bytes` the allocator's reserve.

    Example::

        with MemoryMeter("cpu") as meter:
            model(x).sum().backward()
        print(meter.peak_bytes)
    """

    def __init__(self, device: torch.device | str | None = None, *, trace: bool = False,
                 allocator: bool = False) -> None:
        self.device = _device(device, "MemoryMeter")
        check_flag("trace", trace)
        check_flag("allocator", allocator)
        self.peak_bytes = 0
        self.end_bytes = 0
        self.allocator_peak_bytes: int | None = None
        self.reserved_peak_bytes: int | None = None
        self._allocator = AllocatorMeter(self.device) if allocator else None
        self._want_trace = trace
        self._tracker: _StorageTracker | None = None
        self._events: list[tuple[int, str, int]] | None = None
        self._cuda_start = 0
        self._open = False

    @property
    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    def __enter__(self) -> MemoryMeter:
        # NOTE: one meter measures one region at a time. Entering it again while open would replace its
        # tracker and leave the first dispatch mode active for the rest of the process; nest two meters.
        if self._open:
            raise RuntimeError("this MemoryMeter is already measuring a region; use a second MemoryMeter to nest")
        if self._cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_start = torch.cuda.memory_allocated(self.device)
        if self._allocator is not None and not self._cuda:
            self._allocator.__enter__()
        if not self._cuda or self._want_trace:
            self._tracker = _StorageTracker(trace=self._want_trace)
            self._tracker.__enter__()
        self._open = True
        return self

    def __exit__(self, *exc) -> None:
        self._open = False
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker.__exit__(*exc)
            tracker.close()
            self._events = tracker.events

        if self._cuda:
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._cuda_start
            self.end_bytes = torch.cuda.memory_allocated(self.device) - self._cuda_start
        else:
            self.peak_bytes = tracker.peak
            self.end_bytes = tracker.current
        if self._allocator is not None:
            if self._cuda:  # the same statistics as above: no second reset inside the block
                self._allocator.peak_bytes, self._allocator.reserved_peak_bytes = (
                    self.peak_bytes, torch.cuda.max_memory_reserved(self.device))
            else:
                self._allocator.__exit__(*exc)
            self.allocator_peak_bytes = self._allocator.peak_bytes
            self.reserved_peak_bytes = self._allocator.reserved_peak_bytes

    @property
    def current_bytes(self) -> int:
        """Bytes allocated since entry and still live (readable while the meter is open)."""
        if self._cuda:
            return torch.cuda.memory_allocated(self.device) - self._cuda_start
        return self._tracker.current if self._tracker is not None else self.end_bytes

    @property
    def trace(self) -> pd.DataFrame | None:
        """Memory over time (rows: event, op, bytes) after a block run with `trace=True`."""
        if self._events is None:
            return None
        return pd.DataFrame(self._events, columns=["event", "op", "bytes"])


def _held_tensors(value, seen: set[int] | None = None) -> list[torch.Tensor]:
    """The plain tensors `value` holds: itself, inside containers, inside a tensor subclass that wraps others
    (`__tensor_flatten__`: torchao's 8-bit states) or in the attributes of an object that wraps them (FlashOptim keeps
    its int8 moments and their scales in a `_MaybeQuantizedTensor`). Each object is visited once."""
    seen = set() if seen is None else seen
    if id(value) in seen or value is None or isinstance(value, (str, bytes, int, float, bool)):
        return []
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        if not is_traceable_wrapper_subclass(value):
            return [value]
        return [t for name in value.__tensor_flatten__()[0] for t in _held_tensors(getattr(value, name), seen)]
    if isinstance(value, dict):
        value = list(value.values())
    elif not isinstance(value, (list, tuple, set)):
        value = list(vars(value).values()) if hasattr(value, "__dict__") else []
    return [t for item in value for t in _held_tensors(item, seen)]


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Bytes held by parameters, gradients and optimizer state right now (each storage once).

    Together with a MemoryMeter peak this splits a training step's memory: what is not
    parameters, gradients or optimizer state at the peak is activations and temporaries.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"state_bytes: model must be an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"state_bytes: optimizer must be a torch.optim.Optimizer or None, "
                        f"got {type(optimizer).__name__}")
    seen: set[int] = set()

    def total(tensors) -> int:
        n = 0
        for t in tensors:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage._cdata not in seen:
                    seen.add(storage._cdata)
                    n += storage.nbytes()
        return n

    params = list(model.parameters())
    state = _held_tensors([list(s.values()) for s in optimizer.state.values()]) if optimizer is not None else []
    return {
        "parameters": total(params),
        "gradients": total(p.grad for p in params if p.grad is not None),
        "optimizer_state": total(state),
    }


def measure_training_step(
    model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, *,
    device: torch.device | str, loss_fn: Callable | None = None, trace: bool = False,
    warmup: int = 1, repeats: int = 3,
) -> tuple[dict, pd.DataFrame | None]:
    """Memory and time of one forward + backward step (gradients start as None).

    Returns a record (peak_bytes, grad_bytes: bytes still live after the step once outputs are
    dropped, param_bytes, median_s/min_s/max_s) and, with `trace=True`, memory over time.
    """
    device = _device(device, "measure_training_step")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"measure_training_step: model must be an nn.Module, got {type(model).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"measure_training_step: loss_fn must be a callable (output, labels) -> loss, got {loss_fn!r}")
    loss_fn = loss_fn or torch.nn.functional.cross_entropy
    model = model.to(device).train()
    inputs, labels = inputs.to(device), labels.to(device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(model(inputs), labels).backward()

    timing = time_callable(step, warmup=warmup, repeats=repeats, device=device)
    model.zero_grad(set_to_none=True)
    with MemoryMeter(device, trace=trace) as meter:
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        del loss
    record = {
        "peak_bytes": meter.peak_bytes, "grad_bytes": meter.end_bytes,
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        **{k: v for k, v in timing.as_dict().items() if k != "times"},
    }
    return record, meter.trace


def plot_memory_trace(traces: dict[str, pd.DataFrame], *, title: str = "Memory over one step"):
    """Live tensor memory (MiB) against allocation event, one line per labelled trace."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for label, frame in traces.items():
        ax.plot(frame["event"], frame["bytes"] / 2**20, label=label, lw=1.2)
    ax.set_xlabel("allocation / free event")
    ax.set_ylabel("live tensor memory (MiB)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
